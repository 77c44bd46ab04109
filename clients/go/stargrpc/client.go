// Package stargrpc is a Go client of stargrpc, on the generated stubs of
// github.com/stargrpc/stargrpc/clients/go/stargrpcv1.
//
//	client, err := stargrpc.Dial("localhost:50051", stargrpc.Options{APIKey: key})
//	if err != nil { ... }
//	defer client.Close()
//	result, err := client.Execute(ctx, stargrpc.Call{Tool: "count", Arguments: map[string]any{"to": 3}},
//		func(event *pb.RunEvent) error { fmt.Println(event); return nil })
//
// What it does so callers need not: it sends the API key (or JWT) as `authorization:
// Bearer …` on every call, gives every Execute an idempotency key (generated unless given,
// the same on every retry), retries refusals that say to retry (UNAVAILABLE, and
// RESOURCE_EXHAUSTED with RetryInfo, honouring its delay) with bounded exponential
// backoff, resumes a broken stream with WatchRun after the last seq delivered (every
// event exactly once, in order), takes WatchRun's RUN_FINISHED for the end of a run, and
// decodes refusals into *Error (code, ErrorInfo reason as a pb.ErrorReason, BadRequest
// violations, RetryInfo).
package stargrpc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	mathrand "math/rand"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

// Options configure a Client.
type Options struct {
	// APIKey is an API key or a JWT, sent as `authorization: Bearer …` on every call.
	APIKey string
	// TransportCredentials secure the channel (credentials.NewTLS(…)); nil is plaintext.
	TransportCredentials credentials.TransportCredentials
	// MaxAttempts bounds the tries in a row of one call or one resume (default 5).
	MaxAttempts int
	// Backoff is the first wait between tries; it doubles on each (default 100 ms, at most
	// 5 s, with jitter).
	Backoff time.Duration
	// MaxRetryDelay is the longest RetryInfo delay the client agrees to wait (default 60 s,
	// as the Python client's): a refusal asking for more is returned to the caller at once.
	MaxRetryDelay time.Duration
	// DialOptions are added to Dial's.
	DialOptions []grpc.DialOption
}

// Client calls a stargrpc server. It is safe for concurrent use.
type Client struct {
	conn          *grpc.ClientConn
	ownConn       bool
	stub          pb.ToolServiceClient
	state         pb.RunStateServiceClient
	maxAttempts   int
	backoff       time.Duration
	maxRetryDelay time.Duration
}

// bearer is the per-RPC credential carrying the API key.
type bearer struct {
	token  string
	secure bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

func (b bearer) RequireTransportSecurity() bool { return b.secure }

// KeepaliveTime and KeepaliveTimeout are the HTTP/2 pings of Dial's connection: while a
// call is open it pings after KeepaliveTime without news and takes the connection for dead
// when no answer comes within KeepaliveTimeout. Without them a server that stopped
// answering (a stopped process, a host gone without closing its connections, a network
// cut) holds a call without a deadline for ever; with them the call fails UNAVAILABLE and
// a run's stream is resumed. A stargrpc server accepts pings every 10 s.
const (
	KeepaliveTime    = 20 * time.Second
	KeepaliveTimeout = 10 * time.Second
)

// Dial opens a channel to target (host:port) and returns a client that closes it on Close.
func Dial(target string, opts Options) (*Client, error) {
	// grpc.WithInsecure: Debian's grpc (1.33) has no credentials/insecure package yet.
	transport := grpc.WithInsecure()
	if opts.TransportCredentials != nil {
		transport = grpc.WithTransportCredentials(opts.TransportCredentials)
	}
	dial := []grpc.DialOption{transport, grpc.WithUserAgent("stargrpc-go/0.1.0"),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: KeepaliveTime,
			Timeout: KeepaliveTimeout})}
	if opts.APIKey != "" {
		dial = append(dial, grpc.WithPerRPCCredentials(
			bearer{token: opts.APIKey, secure: opts.TransportCredentials != nil}))
	}
	conn, err := grpc.Dial(target, append(dial, opts.DialOptions...)...)
	if err != nil {
		return nil, err
	}
	client := New(conn, opts)
	client.ownConn = true
	return client, nil
}

// New is a client on an existing connection (left open by Close). The connection must
// carry the credentials itself (Options.APIKey is used by Dial only).
func New(conn *grpc.ClientConn, opts Options) *Client {
	c := &Client{conn: conn, stub: pb.NewToolServiceClient(conn),
		state: pb.NewRunStateServiceClient(conn), maxAttempts: opts.MaxAttempts,
		backoff: opts.Backoff, maxRetryDelay: opts.MaxRetryDelay}
	if c.maxRetryDelay <= 0 {
		c.maxRetryDelay = 60 * time.Second
	}
	if c.maxAttempts <= 0 {
		c.maxAttempts = 5
	}
	if c.backoff <= 0 {
		c.backoff = 100 * time.Millisecond
	}
	return c
}

// Close closes the connection if Dial opened it.
func (c *Client) Close() error {
	if c.ownConn {
		return c.conn.Close()
	}
	return nil
}

// Stub is the generated stub, for what the client does not wrap.
func (c *Client) Stub() pb.ToolServiceClient { return c.stub }

// ListTools is the catalog the caller may see, with its hash.
func (c *Client) ListTools(ctx context.Context) (*pb.ListToolsResponse, error) {
	var reply *pb.ListToolsResponse
	err := c.retry(ctx, func() (err error) {
		reply, err = c.stub.ListTools(ctx, &pb.ListToolsRequest{})
		return err
	})
	return reply, err
}

// Cancel asks a run to stop; it ends with Result{OUTCOME_CANCELLED} and reason. It
// reports whether the run was still going.
func (c *Client) Cancel(ctx context.Context, runID, reason string) (bool, error) {
	var reply *pb.CancelRunResponse
	err := c.retry(ctx, func() (err error) {
		reply, err = c.stub.CancelRun(ctx, &pb.CancelRunRequest{RunId: runID, Reason: reason})
		return err
	})
	if err != nil {
		return false, err
	}
	return reply.GetCancelled(), nil
}

// Steer sends a steering message to a running tool (SteerRun): it reads it through
// ctx.steering(), and the run's log gets a STEERED notice. It is not retried, since a
// retried steer could reach the tool twice.
func (c *Client) Steer(ctx context.Context, runID, message string) error {
	_, err := c.stub.SteerRun(ctx, &pb.SteerRunRequest{RunId: runID, Message: message})
	return FromError(err)
}

// Decision is an approver's answer to a run that waits for approval (ApproveRun).
type Decision struct {
	// Deny denies the run instead of approving it.
	Deny bool
	// Reason says why; a denied run's Result carries it.
	Reason string
	// ArgumentsDigest, when set, is the ApprovalRequest.arguments_digest the approver was
	// shown: the decision is refused when the run's arguments are not those.
	ArgumentsDigest string
}

// Approve decides on a run that waits for approval (ApproveRun), with the approval id of
// its request; the caller needs the server's approver role. It is not retried: a decision
// is taken once.
func (c *Client) Approve(ctx context.Context, runID, approvalID string, decision Decision) (*pb.ApproveRunResponse, error) {
	verdict := pb.ApprovalVerdict_APPROVAL_VERDICT_APPROVE
	if decision.Deny {
		verdict = pb.ApprovalVerdict_APPROVAL_VERDICT_DENY
	}
	reply, err := c.stub.ApproveRun(ctx, &pb.ApproveRunRequest{
		RunId: runID, ApprovalId: approvalID, Decision: verdict, Reason: decision.Reason,
		ArgumentsDigest: decision.ArgumentsDigest,
	})
	if err != nil {
		return nil, FromError(err)
	}
	return reply, nil
}

// Call is one Execute.
type Call struct {
	// Tool is the tool's name.
	Tool string
	// Arguments are encoded with encoding/json (nil: no arguments). Ignored when
	// ArgumentsJSON is set.
	Arguments any
	// ArgumentsJSON is raw JSON text, sent as written (for exact numbers, big integers).
	ArgumentsJSON string
	// IdempotencyKey: repeating a key attaches to (or replays) the first run instead of
	// running the tool again. Generated when empty.
	IdempotencyKey string
	// CatalogHash is the catalog hash the caller planned with; a stale one is refused
	// with FAILED_PRECONDITION, reason CATALOG_STALE. Empty skips the check.
	CatalogHash string
	// Context says who and where the call is for.
	Context *pb.InvocationContext
	// CoalesceDeltas opts in to DELTA coalescing (see ExecuteRequest.coalesce_deltas);
	// also asked for on WatchRun when the stream is resumed.
	CoalesceDeltas bool
	// ParentRunID hangs the run under a run of the caller's own (a call tree an agent
	// started): it is listed in that run's tree and cancelled with it. Empty: top level.
	ParentRunID string
	// Lane runs the call in this lane instead of the tool's (needs the server's
	// lane_override_role). Empty: the tool's lane.
	Lane string
	// Priority in the lane's queue: higher starts first; 0 takes the default.
	Priority int32
	// MaxWaitSeconds refuses the call at once (RESOURCE_EXHAUSTED, LANE_BUSY) when its
	// estimated wait in the lane's queue is longer; 0 waits.
	MaxWaitSeconds float64
	// SessionID runs the call in one of the caller's sessions (CreateSession), so what
	// an earlier call there left (a python variable, a shell file) is still there.
	SessionID string
	// SessionNoWait refuses the call (FAILED_PRECONDITION, reason SESSION_BUSY) instead of
	// waiting while the session runs another.
	SessionNoWait bool
}

// EventHandler receives each event exactly once, in seq order; the last one carries the
// Result. A coalesced message (FirstSeq set) stands for the events FirstSeq..Seq. An
// error returned by the handler ends the call with that error (the run goes on).
type EventHandler func(*pb.RunEvent) error

// NewIdempotencyKey is a random key, as Execute generates one.
func NewIdempotencyKey() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on the systems Go supports
	}
	return hex.EncodeToString(b[:])
}

// Execute runs a tool, passes its events to onEvent (may be nil) and returns the last
// one, which carries the Result.
//
// A refusal before the run starts is an *Error (retried first when it says to retry).
// Once the run has started it is never started again: a broken stream is resumed with
// WatchRun after the last seq delivered. When ctx is cancelled after the run started, the
// run is cancelled too (CancelRun: with its idempotency key it would otherwise go on
// without its caller); when ctx's deadline passes, the server ends the run with outcome
// TIMEOUT, code CLIENT_DEADLINE.
func (c *Client) Execute(ctx context.Context, call Call, onEvent EventHandler) (*pb.RunEvent, error) {
	request := &pb.ExecuteRequest{ToolName: call.Tool, IdempotencyKey: call.IdempotencyKey,
		CatalogHash: call.CatalogHash, Context: call.Context, CoalesceDeltas: call.CoalesceDeltas,
		ParentRunId: call.ParentRunID, Lane: call.Lane, Priority: call.Priority,
		MaxWaitSeconds: call.MaxWaitSeconds, SessionId: call.SessionID, SessionNoWait: call.SessionNoWait}
	if request.IdempotencyKey == "" {
		request.IdempotencyKey = NewIdempotencyKey()
	}
	switch {
	case call.ArgumentsJSON != "":
		request.Args = &pb.ExecuteRequest_ArgumentsJson{ArgumentsJson: call.ArgumentsJSON}
	case call.Arguments != nil:
		text, err := json.Marshal(call.Arguments)
		if err != nil {
			return nil, fmt.Errorf("stargrpc: arguments of %s: %w", call.Tool, err)
		}
		request.Args = &pb.ExecuteRequest_ArgumentsJson{ArgumentsJson: string(text)}
	}
	cur := &cursor{coalesce: call.CoalesceDeltas}
	for attempt := 1; ; attempt++ {
		stream, err := c.stub.Execute(ctx, request)
		if err == nil {
			err = read(executeStream{stream}, cur, onEvent)
		}
		if cur.result != nil {
			return cur.result, nil
		}
		if cur.runID != "" { // the run started: never run it again, resume it
			return c.follow(ctx, cur, onEvent, err)
		}
		if err == nil {
			err = &Error{Code: codes.Unavailable, Message: "the stream ended before the run started"}
		}
		if err = c.pause(ctx, attempt, err); err != nil {
			return nil, err
		}
	}
}

// Watch replays a run's events after afterSeq, then follows it until its Result, passing
// them to onEvent; it returns the Result event. When the run ended at or before afterSeq
// there is nothing to replay: it returns (nil, nil) (the server answers RUN_FINISHED).
func (c *Client) Watch(ctx context.Context, runID string, afterSeq uint64, onEvent EventHandler) (*pb.RunEvent, error) {
	return c.follow(ctx, &cursor{runID: runID, lastSeq: afterSeq, watching: true}, onEvent, nil)
}

// cursor is where a run's delivery stands.
type cursor struct {
	runID    string
	lastSeq  uint64
	result   *pb.RunEvent
	coalesce bool
	// watching: the caller asked for WatchRun itself (a NOT_FOUND is its own answer).
	watching bool
}

type eventStream interface {
	Recv() (*pb.RunEvent, error)
}

type executeStream struct{ pb.ToolService_ExecuteClient }

func (s executeStream) Recv() (*pb.RunEvent, error) {
	r, err := s.ToolService_ExecuteClient.Recv()
	return r.GetEvent(), err
}

type watchStream struct{ pb.ToolService_WatchRunClient }

func (s watchStream) Recv() (*pb.RunEvent, error) {
	r, err := s.ToolService_WatchRunClient.Recv()
	return r.GetEvent(), err
}

// read passes on the new events of one stream: what the cursor has seen is skipped (an
// attach replays from seq 1), a gap is an error, and it stops at the Result. It returns
// the stream's error (nil when the stream ended cleanly or at the Result).
func read(events eventStream, cur *cursor, onEvent EventHandler) error {
	for {
		event, err := events.Recv()
		if err != nil {
			if err == io.EOF {
				return nil
			}
			return FromError(err)
		}
		if cur.runID != "" && event.GetRunId() != cur.runID {
			return &ResumeError{RunID: cur.runID, LastSeq: cur.lastSeq,
				Msg: fmt.Sprintf("the server switched from run %s to %s", cur.runID, event.GetRunId())}
		}
		first := event.GetSeq()
		if event.GetFirstSeq() != 0 {
			first = event.GetFirstSeq()
		}
		if event.GetSeq() <= cur.lastSeq {
			continue
		}
		if first != cur.lastSeq+1 {
			return &ResumeError{RunID: event.GetRunId(), LastSeq: cur.lastSeq,
				Msg: fmt.Sprintf("events %d..%d of run %s are missing", cur.lastSeq+1, first-1, event.GetRunId())}
		}
		cur.runID, cur.lastSeq = event.GetRunId(), event.GetSeq()
		if event.GetResult() != nil {
			cur.result = event
		}
		if onEvent != nil {
			if err := onEvent(event); err != nil {
				return &handlerError{err}
			}
		}
		if cur.result != nil {
			return nil
		}
	}
}

// handlerError carries the error of the caller's EventHandler through unchanged.
type handlerError struct{ err error }

func (h *handlerError) Error() string { return h.err.Error() }
func (h *handlerError) Unwrap() error { return h.err }

// follow watches the cursor's run until its Result, resuming as often as MaxAttempts
// allows in a row (a delivered event resets the count). broken is the failure of the
// stream being resumed, if any.
func (c *Client) follow(ctx context.Context, cur *cursor, onEvent EventHandler, broken error) (*pb.RunEvent, error) {
	if h, ok := broken.(*handlerError); ok {
		return nil, h.err
	}
	if _, ok := broken.(*ResumeError); ok {
		return nil, broken
	}
	if broken != nil && !resumable(broken) {
		return nil, c.stopped(ctx, cur, broken)
	}
	for attempt := 1; ; attempt++ {
		seen := cur.lastSeq
		stream, err := c.stub.WatchRun(ctx, &pb.WatchRunRequest{RunId: cur.runID,
			AfterSeq: cur.lastSeq, CoalesceDeltas: cur.coalesce})
		if err == nil {
			err = read(watchStream{stream}, cur, onEvent)
		}
		if cur.result != nil {
			return cur.result, nil
		}
		if cur.lastSeq != seen {
			attempt, cur.watching = 1, false
		}
		switch e := err.(type) {
		case nil:
			err = &Error{Code: codes.Unavailable, Message: "the stream ended before the run's Result"}
		case *handlerError:
			return nil, e.err
		case *ResumeError:
			return nil, e
		case *Error:
			if e.Reason == pb.ErrorReason_RUN_FINISHED && endedBy(e) <= cur.lastSeq {
				return nil, nil // the run ended at or before what the caller has seen
			}
			if e.Code == codes.NotFound && !cur.watching {
				return nil, &ResumeError{RunID: cur.runID, LastSeq: cur.lastSeq,
					Msg: fmt.Sprintf("run %s can no longer be watched", cur.runID), Err: e}
			}
		}
		if !resumable(err) || ctx.Err() != nil {
			return nil, c.stopped(ctx, cur, err)
		}
		if attempt >= c.maxAttempts {
			return nil, &ResumeError{RunID: cur.runID, LastSeq: cur.lastSeq, Err: err,
				Msg: fmt.Sprintf("run %s could not be resumed after %d tries", cur.runID, attempt)}
		}
		if err := c.sleep(ctx, c.delay(attempt, nil)); err != nil {
			return nil, c.stopped(ctx, cur, err)
		}
	}
}

// stopped ends a started run's delivery with err; when the caller cancelled ctx, the run
// is cancelled as well.
func (c *Client) stopped(ctx context.Context, cur *cursor, err error) error {
	if ctx.Err() == context.Canceled && !cur.watching {
		cancelCtx, done := context.WithTimeout(context.Background(), 5*time.Second)
		defer done()
		if _, cancelErr := c.Cancel(cancelCtx, cur.runID, "the caller's context was cancelled"); cancelErr != nil {
			return fmt.Errorf("%w (and cancelling run %s failed: %v)", ctx.Err(), cur.runID, cancelErr)
		}
		return fmt.Errorf("run %s cancelled: %w", cur.runID, ctx.Err())
	}
	if ctx.Err() != nil {
		return FromError(err)
	}
	return err
}

// endedBy is the seq of the Result a RUN_FINISHED answer names (metadata last_seq); one
// that names none counts as never seen, so it is not taken for the end.
func endedBy(e *Error) uint64 {
	seq, err := strconv.ParseUint(e.Metadata["last_seq"], 10, 64)
	if err != nil {
		return ^uint64(0)
	}
	return seq
}

// resumable: the codes on which a broken stream is resumed (not the caller's own
// deadline or cancellation).
func resumable(err error) bool {
	e, ok := err.(*Error)
	if !ok {
		return false
	}
	switch e.Code {
	case codes.Unavailable, codes.Unknown, codes.Internal, codes.Aborted, codes.ResourceExhausted:
		return true
	case codes.Canceled:
		// The caller's own cancellation arrives as Canceled too; ctx tells them apart.
		return e.Message != context.Canceled.Error()
	}
	return false
}

// retryable: refusals before a run starts that say to try again. LANE_BUSY is not one:
// the caller's own MaxWaitSeconds refused the wait its RetryInfo estimates.
func retryable(err error) bool {
	e, ok := err.(*Error)
	if !ok {
		return false
	}
	return e.Code == codes.Unavailable || (e.Code == codes.ResourceExhausted && e.HasRetryDelay &&
		e.Reason != pb.ErrorReason_LANE_BUSY)
}

// retry runs a unary call with the retry policy.
func (c *Client) retry(ctx context.Context, call func() error) error {
	for attempt := 1; ; attempt++ {
		err := FromError(call())
		if err == nil {
			return nil
		}
		if err = c.pause(ctx, attempt, err); err != nil {
			return err
		}
	}
}

// pause waits before another try of a refused call, or returns the error to give up with:
// a RetryInfo delay longer than MaxRetryDelay, or one that would pass ctx's deadline, is
// not waited for.
func (c *Client) pause(ctx context.Context, attempt int, err error) error {
	if !retryable(err) || attempt >= c.maxAttempts || ctx.Err() != nil {
		return err
	}
	e, _ := err.(*Error)
	if e.HasRetryDelay && e.RetryDelay > c.maxRetryDelay {
		return err
	}
	wait := c.delay(attempt, e)
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= wait {
		return err
	}
	if sleepErr := c.sleep(ctx, wait); sleepErr != nil {
		return err
	}
	return nil
}

// delay is the wait before try attempt+1: RetryInfo's when the server sent one, else
// exponential backoff with jitter.
func (c *Client) delay(attempt int, e *Error) time.Duration {
	if e != nil && e.HasRetryDelay {
		return e.RetryDelay
	}
	wait := c.backoff << (attempt - 1)
	if wait > 5*time.Second || wait <= 0 {
		wait = 5 * time.Second
	}
	return wait/2 + time.Duration(mathrand.Int63n(int64(wait/2)+1))
}

func (c *Client) sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}
