package stargrpc

import (
	"context"
	"fmt"
	"strings"
	"time"

	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

// StateScopes are the names of the scopes of run state, as ParseStateScope takes them.
var StateScopes = []string{"run", "tree", "principal", "global"}

// RunScope is one run's own state.
func RunScope(runID string) *pb.StateScopeRef {
	return &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_RUN, RunId: runID}
}

// TreeScope is the shared state of the call tree whose root run is rootRunID.
func TreeScope(rootRunID string) *pb.StateScopeRef {
	return &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_TREE, RunId: rootRunID}
}

// PrincipalScope is one principal's state across runs (the id the audit names).
func PrincipalScope(principal string) *pb.StateScopeRef {
	return &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_PRINCIPAL, Principal: principal}
}

// GlobalScope is the state every tool reads.
func GlobalScope() *pb.StateScopeRef {
	return &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_GLOBAL}
}

// ParseStateScope is the scope named "run", "tree", "principal" or "global", with the run
// (run, tree) or principal (principal) it needs. The server checks the ids themselves.
func ParseStateScope(name, runID, principal string) (*pb.StateScopeRef, error) {
	switch name {
	case "run", "tree":
		if runID == "" {
			return nil, fmt.Errorf("scope %s needs a run id", name)
		}
		if name == "run" {
			return RunScope(runID), nil
		}
		return TreeScope(runID), nil
	case "principal":
		if principal == "" {
			return nil, fmt.Errorf("scope principal needs a principal id")
		}
		return PrincipalScope(principal), nil
	case "global":
		return GlobalScope(), nil
	}
	return nil, fmt.Errorf("no state scope %q: %s", name, strings.Join(StateScopes, ", "))
}

// StateStub is the generated RunStateService stub, for what the client does not wrap.
func (c *Client) StateStub() pb.RunStateServiceClient { return c.state }

// GetState is the value of key in a scope of run state as canonical JSON text, and whether
// the key holds one (RunStateService.GetState; admin role). A refusal is an *Error:
// PERMISSION_DENIED for anyone but an admin, INVALID_ARGUMENT (reason STATE_BAD_KEY,
// STATE_BAD_SCOPE) for a bad key or scope, UNAVAILABLE (STATE_UNAVAILABLE) when the store
// does not answer.
func (c *Client) GetState(ctx context.Context, scope *pb.StateScopeRef, key string) (valueJSON string, found bool, err error) {
	var reply *pb.GetStateResponse
	err = c.retry(ctx, func() (err error) {
		reply, err = c.state.GetState(ctx, &pb.GetStateRequest{Scope: scope, Key: key})
		return err
	})
	if err != nil {
		return "", false, err
	}
	return reply.GetValueJson(), reply.GetFound(), nil
}

// SetState sets key in a scope of run state to valueJSON, JSON text sent as written (so
// large integers keep every digit), for ttl (0: as long as the scope); admin role. Beyond
// GetState's refusals: INVALID_ARGUMENT STATE_VALUE_NOT_JSON or STATE_VALUE_TOO_LARGE, and
// RESOURCE_EXHAUSTED STATE_QUOTA_EXCEEDED over the scope's quota.
func (c *Client) SetState(ctx context.Context, scope *pb.StateScopeRef, key, valueJSON string, ttl time.Duration) error {
	request := &pb.SetStateRequest{Scope: scope, Key: key, ValueJson: valueJSON,
		TtlSeconds: ttl.Seconds()}
	// Setting the same value again is harmless, so a refusal that says to retry is retried.
	return c.retry(ctx, func() error {
		_, err := c.state.SetState(ctx, request)
		return err
	})
}

// DeleteState removes key from a scope of run state; whether it was there (admin role).
// Not retried: a delete whose reply was lost would be retried into "it was not there".
func (c *Client) DeleteState(ctx context.Context, scope *pb.StateScopeRef, key string) (bool, error) {
	reply, err := c.state.DeleteState(ctx, &pb.DeleteStateRequest{Scope: scope, Key: key})
	if err != nil {
		return false, FromError(err)
	}
	return reply.GetDeleted(), nil
}

// StatePage says which page of a scope's keys ListState returns.
type StatePage struct {
	// Prefix keeps only the keys starting with it.
	Prefix string
	// PageSize is the most entries (0: the server's default, 100; at most 1000).
	PageSize int32
	// AfterKey is the previous page's NextAfterKey (empty: the first page).
	AfterKey string
	// WithValues returns each entry's value too.
	WithValues bool
}

// ListState is one page of the keys of a scope of run state, sorted (admin role); its
// NextAfterKey is where the next page starts, empty when no key is left.
func (c *Client) ListState(ctx context.Context, scope *pb.StateScopeRef, page StatePage) (*pb.ListStateResponse, error) {
	request := &pb.ListStateRequest{Scope: scope, Prefix: page.Prefix, PageSize: page.PageSize,
		AfterKey: page.AfterKey, WithValues: page.WithValues}
	var reply *pb.ListStateResponse
	err := c.retry(ctx, func() (err error) {
		reply, err = c.state.ListState(ctx, request)
		return err
	})
	return reply, err
}
