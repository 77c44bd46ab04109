package stargrpc

import (
	"errors"
	"io"
	"testing"
	"time"

	"github.com/golang/protobuf/ptypes/duration"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

func TestFromErrorDecodesTheRichDetails(t *testing.T) {
	st, err := status.New(codes.InvalidArgument, "invalid arguments").WithDetails(
		&errdetails.ErrorInfo{Reason: "INVALID_ARGUMENT", Domain: "stargrpc",
			Metadata: map[string]string{"tool": "count"}},
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{
			{Field: "arguments.to", Description: "not an integer"}}},
		&errdetails.RetryInfo{RetryDelay: &duration.Duration{Seconds: 1, Nanos: 500000000}})
	if err != nil {
		t.Fatal(err)
	}

	e, ok := AsError(FromError(st.Err()))

	if !ok {
		t.Fatalf("not an *Error")
	}
	if e.Code != codes.InvalidArgument || e.Reason != pb.ErrorReason_INVALID_ARGUMENT ||
		e.Domain != "stargrpc" || e.Metadata["tool"] != "count" {
		t.Errorf("decoded %+v", e)
	}
	if len(e.Violations) != 1 || e.Violations[0] != (Violation{"arguments.to", "not an integer"}) {
		t.Errorf("violations %+v", e.Violations)
	}
	if !e.HasRetryDelay || e.RetryDelay != 1500*time.Millisecond {
		t.Errorf("retry delay %v", e.RetryDelay)
	}
	want := "INVALID_ARGUMENT: invalid arguments [INVALID_ARGUMENT]\n  arguments.to: not an integer"
	if e.Error() != want {
		t.Errorf("Error() = %q", e.Error())
	}
	if !errors.Is(e, &Error{Code: codes.InvalidArgument}) {
		t.Errorf("errors.Is by code")
	}
	if status.Code(e) != codes.InvalidArgument {
		t.Errorf("status.Code of the decoded error")
	}
}

func TestAnUnknownReasonIsUnspecifiedButKeptAsSent(t *testing.T) {
	st, _ := status.New(codes.FailedPrecondition, "no").WithDetails(
		&errdetails.ErrorInfo{Reason: "PLUGIN_OWN_CODE"})

	e, _ := AsError(FromError(st.Err()))

	if e.Reason != pb.ErrorReason_ERROR_REASON_UNSPECIFIED || e.ReasonName != "PLUGIN_OWN_CODE" {
		t.Errorf("decoded %+v", e)
	}
	if ParseReason("CATALOG_STALE") != pb.ErrorReason_CATALOG_STALE {
		t.Errorf("ParseReason")
	}
}

func TestEndedByReadsLastSeqAndTreatsItsAbsenceAsNeverSeen(t *testing.T) {
	if endedBy(&Error{Metadata: map[string]string{"last_seq": "8"}}) != 8 {
		t.Error("last_seq 8")
	}
	if endedBy(&Error{Metadata: map[string]string{}}) != ^uint64(0) {
		t.Error("no last_seq")
	}
}

// events is a stream of canned events, then io.EOF.
type events []*pb.RunEvent

func (e *events) Recv() (*pb.RunEvent, error) {
	if len(*e) == 0 {
		return nil, io.EOF
	}
	event := (*e)[0]
	*e = (*e)[1:]
	return event, nil
}

func delta(seq, first uint64) *pb.RunEvent {
	return &pb.RunEvent{RunId: "r", Seq: seq, FirstSeq: first, Kind: &pb.RunEvent_Step{
		Step: &pb.StepEvent{Phase: pb.StepPhase_STEP_PHASE_DELTA}}}
}

func TestReadSkipsWhatWasSeenAcceptsCoalescedAndStopsAtTheResult(t *testing.T) {
	result := &pb.RunEvent{RunId: "r", Seq: 6, Kind: &pb.RunEvent_Result{Result: &pb.Result{}}}
	stream := events{delta(1, 0), delta(2, 0), delta(3, 0), delta(5, 4), result, delta(7, 0)}
	cur := &cursor{runID: "r", lastSeq: 2}
	var got []uint64

	err := read(&stream, cur, func(e *pb.RunEvent) error { got = append(got, e.GetSeq()); return nil })

	if err != nil || cur.result != result || cur.lastSeq != 6 {
		t.Fatalf("err %v, cursor %+v", err, cur)
	}
	if len(got) != 3 || got[0] != 3 || got[1] != 5 || got[2] != 6 {
		t.Errorf("delivered %v", got)
	}
}

func TestReadRefusesAGapAndAnotherRun(t *testing.T) {
	gap := events{delta(1, 0), delta(3, 0)}
	err := read(&gap, &cursor{}, nil)
	var resume *ResumeError
	if !errors.As(err, &resume) || resume.LastSeq != 1 {
		t.Errorf("gap: %v", err)
	}

	other := events{delta(1, 0)}
	if err := read(&other, &cursor{runID: "another"}, nil); !errors.As(err, &resume) {
		t.Errorf("another run: %v", err)
	}
}

func TestResumableLeavesTheCallersOwnEndsAlone(t *testing.T) {
	for code, want := range map[codes.Code]bool{codes.Unavailable: true, codes.Internal: true,
		codes.DeadlineExceeded: false, codes.InvalidArgument: false, codes.NotFound: false} {
		if resumable(&Error{Code: code}) != want {
			t.Errorf("%v: want %v", code, want)
		}
	}
	if resumable(&Error{Code: codes.Canceled, Message: "context canceled"}) {
		t.Error("the caller's cancellation is not a cut")
	}
}

func TestLaneBusyIsNotRetriedButLaneFullIs(t *testing.T) {
	refusal := func(reason string) error {
		st, _ := status.New(codes.ResourceExhausted, "lane").WithDetails(
			&errdetails.ErrorInfo{Reason: reason},
			&errdetails.RetryInfo{RetryDelay: &duration.Duration{Seconds: 2}})
		return FromError(st.Err())
	}
	if retryable(refusal("LANE_BUSY")) {
		t.Errorf("LANE_BUSY retried: the caller's max wait refused that wait")
	}
	if !retryable(refusal("LANE_FULL")) {
		t.Errorf("LANE_FULL with RetryInfo not retried")
	}
}
