package stargrpc

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

// Violation is one field of a BadRequest: the field's path (such as "arguments.to") and
// what is wrong with it.
type Violation struct {
	Field       string
	Description string
}

// Error is a call the server refused (or a stream that failed), with the google.rpc
// details of its status decoded.
type Error struct {
	// Code is the gRPC status code.
	Code codes.Code
	// Message is the status message.
	Message string
	// Reason is ErrorInfo.reason as a constant; ERROR_REASON_UNSPECIFIED when the status
	// carries none or one this version of the contract does not know (see ReasonName).
	Reason pb.ErrorReason
	// ReasonName is ErrorInfo.reason as sent ("" when there is none).
	ReasonName string
	// Domain is ErrorInfo.domain ("stargrpc").
	Domain string
	// Metadata is ErrorInfo.metadata (for RUN_FINISHED: run_id, last_seq, outcome).
	Metadata map[string]string
	// Violations are the BadRequest field violations.
	Violations []Violation
	// RetryDelay is RetryInfo.retry_delay; HasRetryDelay says whether the server sent one.
	RetryDelay    time.Duration
	HasRetryDelay bool

	status *status.Status
}

// Error renders the code, the message, the reason and each field violation.
func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s", CodeName(e.Code), e.Message)
	if e.ReasonName != "" {
		fmt.Fprintf(&b, " [%s]", e.ReasonName)
	}
	for _, v := range e.Violations {
		fmt.Fprintf(&b, "\n  %s: %s", v.Field, v.Description)
	}
	return b.String()
}

// GRPCStatus returns the status the error was decoded from (status.FromError uses it).
func (e *Error) GRPCStatus() *status.Status {
	if e.status == nil {
		return status.New(e.Code, e.Message)
	}
	return e.status
}

// Is reports whether target is an *Error with the same code and reason, so
// errors.Is(err, &stargrpc.Error{Code: codes.NotFound, Reason: pb.ErrorReason_TOOL_NOT_FOUND})
// works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && (t.Reason == 0 || t.Reason == e.Reason)
}

// AsError finds the *Error in err's chain.
func AsError(err error) (*Error, bool) {
	var e *Error
	ok := errors.As(err, &e)
	return e, ok
}

// ReasonOf is the ErrorInfo reason of err as a constant (ERROR_REASON_UNSPECIFIED when
// err is not a decoded refusal or carries no known reason).
func ReasonOf(err error) pb.ErrorReason {
	if e, ok := AsError(err); ok {
		return e.Reason
	}
	return pb.ErrorReason_ERROR_REASON_UNSPECIFIED
}

// ParseReason maps a code as sent (ErrorInfo.reason, ResultError.code, Notice.code) to its
// constant; an unknown one, such as a tool plug-in's own, is ERROR_REASON_UNSPECIFIED.
func ParseReason(name string) pb.ErrorReason {
	return pb.ErrorReason(pb.ErrorReason_value[name])
}

// FromError decodes a gRPC error into an *Error; an error that is not a gRPC status (a
// context error, for one) and nil are returned unchanged.
func FromError(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := AsError(err); ok {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	return fromStatus(st)
}

func fromStatus(st *status.Status) *Error {
	e := &Error{Code: st.Code(), Message: st.Message(), Metadata: map[string]string{}, status: st}
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			e.ReasonName, e.Domain = d.GetReason(), d.GetDomain()
			e.Reason = ParseReason(e.ReasonName)
			for k, v := range d.GetMetadata() {
				e.Metadata[k] = v
			}
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				e.Violations = append(e.Violations, Violation{v.GetField(), v.GetDescription()})
			}
		case *errdetails.RetryInfo:
			if delay := d.GetRetryDelay(); delay != nil {
				e.RetryDelay = time.Duration(delay.GetSeconds())*time.Second +
					time.Duration(delay.GetNanos())
				e.HasRetryDelay = true
			}
		}
	}
	return e
}

// codeNames are the canonical names: codes.Code.String gives "NotFound", the contract and
// the other clients say NOT_FOUND.
var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
	codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
	codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
	codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED",
	codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS",
	codes.Unauthenticated: "UNAUTHENTICATED",
}

// CodeName is the canonical upper-case name of a gRPC code, such as "NOT_FOUND".
func CodeName(c codes.Code) string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return c.String()
}

// ResumeError says a run's stream broke and could not be resumed without a gap.
type ResumeError struct {
	RunID   string
	LastSeq uint64
	Msg     string
	// Err is the last failure, when there was one.
	Err error
}

func (e *ResumeError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%s: %v", e.Msg, e.Err)
	}
	return e.Msg
}

// Unwrap gives the last failure.
func (e *ResumeError) Unwrap() error { return e.Err }
