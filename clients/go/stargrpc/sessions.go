package stargrpc

import (
	"context"

	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

// SessionLimits are what CreateSession asks for; a zero field takes the server's default.
type SessionLimits struct {
	// TTLSeconds is how long the session lives at most.
	TTLSeconds uint32
	// IdleSeconds closes it after this long without a call.
	IdleSeconds uint32
	// MemoryMB, CPUSeconds and DiskMB bound its sandbox.
	MemoryMB   uint32
	CPUSeconds uint32
	DiskMB     uint32
}

// CreateSession opens a session: a sandbox kept across calls ("python": a live
// interpreter whose variables stay; "shell": a folder whose files stay). Run calls in it
// with Call.SessionID. It is not retried: a retry could open two.
func (c *Client) CreateSession(ctx context.Context, kind string, limits SessionLimits) (*pb.Session, error) {
	reply, err := c.stub.CreateSession(ctx, &pb.CreateSessionRequest{
		Kind: kind, TtlSeconds: limits.TTLSeconds, IdleSeconds: limits.IdleSeconds,
		MemoryMb: limits.MemoryMB, CpuSeconds: limits.CPUSeconds, DiskMb: limits.DiskMB,
	})
	if err != nil {
		return nil, FromError(err)
	}
	return reply.GetSession(), nil
}

// ListSessions is the caller's open sessions, with their running totals.
func (c *Client) ListSessions(ctx context.Context) ([]*pb.Session, error) {
	var reply *pb.ListSessionsResponse
	err := c.retry(ctx, func() (err error) {
		reply, err = c.stub.ListSessions(ctx, &pb.ListSessionsRequest{})
		return err
	})
	if err != nil {
		return nil, err
	}
	return reply.GetSessions(), nil
}

// CloseSession closes one of the caller's sessions; a call in it afterwards is refused
// (reason SESSION_NOT_FOUND). It is not retried: a retry after a close that went through
// would be refused as not found.
func (c *Client) CloseSession(ctx context.Context, sessionID string) error {
	_, err := c.stub.CloseSession(ctx, &pb.CloseSessionRequest{SessionId: sessionID})
	return FromError(err)
}
