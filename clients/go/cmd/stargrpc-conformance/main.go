// Command stargrpc-conformance is the Go runner of the conformance suite
// (conformance/cases.json): it runs every case with the Go client against one live server
// started with --tools-dir conformance/tools, prints "PASS name" or "FAIL name: why" per
// case, then "N passed, M failed", and exits 1 when a case failed.
//
//	stargrpc-conformance -cases conformance/cases.json -target 127.0.0.1:50051 -api-key "$STARGRPC_API_KEY"
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/stargrpc/stargrpc/clients/go/stargrpc"
	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

type testCase struct {
	Name           string          `json:"name"`
	Tool           string          `json:"tool"`
	Arguments      json.RawMessage `json:"arguments"`
	ArgumentsJSON  string          `json:"arguments_json"`
	CatalogHash    string          `json:"catalog_hash"`
	CutAfterEvents int             `json:"cut_after_events"`
	ReuseArguments json.RawMessage `json:"reuse_arguments"`
	Deadline       float64         `json:"deadline_seconds"`
	Coalesce       bool            `json:"coalesce_deltas"`
	Pause          float64         `json:"pause_seconds"`
	Output         string          `json:"output"`
}

func (c testCase) call() stargrpc.Call {
	args := c.ArgumentsJSON
	if args == "" {
		args = string(c.Arguments)
	}
	return stargrpc.Call{Tool: c.Tool, ArgumentsJSON: args, CatalogHash: c.CatalogHash,
		CoalesceDeltas: c.Coalesce}
}

func (c testCase) intArgument(name string) int {
	var args map[string]json.Number
	if err := json.Unmarshal(c.Arguments, &args); err != nil {
		return 0
	}
	n, _ := strconv.Atoi(string(args[name]))
	return n
}

type failed string

func (f failed) Error() string { return string(f) }

func check(ok bool, format string, args ...any) {
	if !ok {
		panic(failed(fmt.Sprintf(format, args...)))
	}
}

type runner struct {
	target, apiKey string
	client         *stargrpc.Client
}

func main() {
	casesPath := flag.String("cases", "conformance/cases.json", "the case list")
	target := flag.String("target", envOr("STARGRPC_TARGET", "localhost:50051"), "server address")
	apiKey := flag.String("api-key", os.Getenv("STARGRPC_API_KEY"), "API key or JWT")
	flag.Parse()
	text, err := os.ReadFile(*casesPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var doc struct {
		Cases []testCase `json:"cases"`
	}
	if err := json.Unmarshal(text, &doc); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	client, err := stargrpc.Dial(*target, stargrpc.Options{APIKey: *apiKey})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	defer client.Close()
	r := &runner{target: *target, apiKey: *apiKey, client: client}
	failures := 0
	for _, c := range doc.Cases {
		if why := r.run(c); why != "" {
			failures++
			fmt.Printf("FAIL %s: %s\n", c.Name, strings.Join(strings.Fields(why), " "))
		} else {
			fmt.Printf("PASS %s\n", c.Name)
		}
	}
	fmt.Printf("%d passed, %d failed\n", len(doc.Cases)-failures, failures)
	if failures > 0 {
		os.Exit(1)
	}
}

func envOr(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

// run runs one case; the reason it failed, or "".
func (r *runner) run(c testCase) (why string) {
	cases := map[string]func(context.Context, testCase){
		"seq_gapless_from_1":                r.seqGapless,
		"steps_start_delta_end_nested":      r.stepsNested,
		"one_result_last":                   r.oneResultLast,
		"bad_arguments_bad_request":         r.badArguments,
		"unknown_tool_not_found":            r.unknownTool,
		"stale_catalog_refused":             r.staleCatalog,
		"cancel_then_watch_shows_cancelled": r.cancelThenWatch,
		"resume_after_cut":                  r.resumeAfterCut,
		"run_finished_past_the_end":         r.runFinished,
		"idempotent_attach_replay_reuse":    r.idempotent,
		"client_deadline_timeout":           r.clientDeadline,
		"chunked_file_sha256":               r.chunkedFile,
		"coalesced_deltas_gapless":          r.coalesced,
		"big_integer_arguments_json":        r.bigInteger,
	}
	fn, ok := cases[c.Name]
	if !ok {
		return "not implemented by this runner"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	defer func() {
		if p := recover(); p != nil {
			why = fmt.Sprint(p)
		}
	}()
	fn(ctx, c)
	return ""
}

// events runs one Execute and returns its events, or fails the case.
func (r *runner) events(ctx context.Context, client *stargrpc.Client, call stargrpc.Call) []*pb.RunEvent {
	var events []*pb.RunEvent
	_, err := client.Execute(ctx, call, func(e *pb.RunEvent) error {
		events = append(events, e)
		return nil
	})
	check(err == nil, "%v", err)
	return events
}

func (r *runner) refusal(ctx context.Context, call stargrpc.Call) *stargrpc.Error {
	_, err := r.client.Execute(ctx, call, nil)
	check(err != nil, "the call was not refused")
	e, ok := stargrpc.AsError(err)
	check(ok, "not a decoded refusal: %v", err)
	return e
}

func checkRefused(e *stargrpc.Error, code codes.Code, reason pb.ErrorReason) {
	check(e.Code == code && e.Reason == reason, "refused %s [%s], not %s [%s]",
		stargrpc.CodeName(e.Code), e.ReasonName, stargrpc.CodeName(code), reason)
}

func checkGapless(events []*pb.RunEvent) {
	for i, e := range events {
		check(e.GetSeq() == uint64(i+1), "event %d has seq %d", i+1, e.GetSeq())
		check(e.GetRunId() == events[0].GetRunId(), "events of more than one run")
	}
}

func checkEndsWithResult(events []*pb.RunEvent, outcome pb.Outcome, output *string) {
	var results []int
	for i, e := range events {
		if e.GetResult() != nil {
			results = append(results, i)
		}
	}
	check(len(results) == 1 && results[0] == len(events)-1, "Results at %v of %d events", results, len(events))
	result := events[len(events)-1].GetResult()
	check(result.GetOutcome() == outcome, "outcome %s (%s %s)", result.GetOutcome(),
		result.GetError().GetCode(), result.GetError().GetMessage())
	if output != nil {
		check(result.GetOutput() == *output, "output %q", result.GetOutput())
	}
}

func text(s string) *string { return &s }

func (r *runner) seqGapless(ctx context.Context, c testCase) {
	checkGapless(r.events(ctx, r.client, c.call()))
}

func (r *runner) stepsNested(ctx context.Context, c testCase) {
	parents := map[string]string{}
	var order []string
	ended := map[string]bool{}
	deltas := map[string][]string{}
	for _, e := range r.events(ctx, r.client, c.call()) {
		se := e.GetStep()
		if se == nil {
			continue
		}
		id, parent := se.GetStep().GetId(), se.GetStep().GetParentId()
		_, started := parents[id]
		switch se.GetPhase() {
		case pb.StepPhase_STEP_PHASE_START:
			check(!started, "step %s started twice", id)
			if len(order) == 0 {
				check(parent == "", "the first step has a parent")
			} else {
				_, parentStarted := parents[parent]
				check(parentStarted && !ended[parent], "step %s starts outside a running parent %q", id, parent)
			}
			parents[id] = parent
			order = append(order, id)
		case pb.StepPhase_STEP_PHASE_DELTA:
			check(started && !ended[id], "delta outside step %s", id)
			deltas[id] = append(deltas[id], se.GetDelta())
		default:
			check(started && !ended[id], "step %s ends twice", id)
			for child, p := range parents {
				check(p != id || ended[child], "step %s ends before its child %s", id, child)
			}
			check(se.GetStep().GetStatus() == pb.StepStatus_STEP_STATUS_COMPLETE, "step %s status", id)
			ended[id] = true
		}
	}
	check(len(ended) == len(parents), "a step never ended")
	var inner string
	for _, id := range order[1:] {
		check(parents[id] != "", "more than one top-level step")
		if parents[parents[id]] != "" && inner == "" {
			inner = id
		}
	}
	check(inner != "", "no step nested two levels deep")
	check(reflect.DeepEqual(deltas[inner], []string{"1\n", "2\n", "3\n"}), "inner deltas %q", deltas[inner])
}

func (r *runner) oneResultLast(ctx context.Context, c testCase) {
	checkEndsWithResult(r.events(ctx, r.client, c.call()), pb.Outcome_OUTCOME_OK, text("steps 3"))
}

func (r *runner) badArguments(ctx context.Context, c testCase) {
	e := r.refusal(ctx, c.call())
	checkRefused(e, codes.InvalidArgument, pb.ErrorReason_INVALID_ARGUMENT)
	for _, v := range e.Violations {
		if v.Field == "arguments.items" {
			return
		}
	}
	check(false, "violations %v", e.Violations)
}

func (r *runner) unknownTool(ctx context.Context, c testCase) {
	checkRefused(r.refusal(ctx, c.call()), codes.NotFound, pb.ErrorReason_TOOL_NOT_FOUND)
}

func (r *runner) staleCatalog(ctx context.Context, c testCase) {
	checkRefused(r.refusal(ctx, c.call()), codes.FailedPrecondition, pb.ErrorReason_CATALOG_STALE)
}

func (r *runner) cancelThenWatch(ctx context.Context, c testCase) {
	callCtx, cancel := context.WithCancel(ctx)
	var runID string
	_, err := r.client.Execute(callCtx, c.call(), func(e *pb.RunEvent) error {
		runID = e.GetRunId()
		cancel() // the Go way: cancelling the context cancels the run
		return nil
	})
	check(errors.Is(err, context.Canceled), "the call ended with %v", err)
	var watched []*pb.RunEvent
	_, err = r.client.Watch(ctx, runID, 0, func(e *pb.RunEvent) error {
		watched = append(watched, e)
		return nil
	})
	check(err == nil, "%v", err)
	checkGapless(watched)
	checkEndsWithResult(watched, pb.Outcome_OUTCOME_CANCELLED, nil)
}

// proxy is a TCP proxy whose cut closes every connection through it; it keeps accepting.
type proxy struct {
	listener    net.Listener
	mu          sync.Mutex
	conns       []net.Conn
	connections int
}

func startProxy(target string) *proxy {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	check(err == nil, "%v", err)
	p := &proxy{listener: listener}
	go func() {
		for {
			down, err := listener.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				down.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, down, up)
			p.connections++
			p.mu.Unlock()
			go pipe(down, up)
			go pipe(up, down)
		}
	}()
	return p
}

func pipe(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	dst.Close()
}

func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, conn := range p.conns {
		conn.Close()
	}
	p.conns = nil
}

func (p *proxy) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.connections
}

func (r *runner) resumeAfterCut(ctx context.Context, c testCase) {
	p := startProxy(r.target)
	defer p.listener.Close()
	defer p.cut()
	client, err := stargrpc.Dial(p.listener.Addr().String(), stargrpc.Options{APIKey: r.apiKey})
	check(err == nil, "%v", err)
	defer client.Close()
	var events []*pb.RunEvent
	_, err = client.Execute(ctx, c.call(), func(e *pb.RunEvent) error {
		events = append(events, e)
		if len(events) == c.CutAfterEvents {
			p.cut()
		}
		return nil
	})
	check(err == nil, "%v", err)
	checkGapless(events)
	checkEndsWithResult(events, pb.Outcome_OUTCOME_OK, text("steps 6"))
	check(p.count() > 1, "the client did not connect again after the cut")
}

func (r *runner) runFinished(ctx context.Context, c testCase) {
	events := r.events(ctx, r.client, c.call())
	last := events[len(events)-1]
	stream, err := r.client.Stub().WatchRun(ctx, &pb.WatchRunRequest{RunId: last.GetRunId(), AfterSeq: last.GetSeq()})
	check(err == nil, "%v", err)
	_, err = stream.Recv()
	e, ok := stargrpc.AsError(stargrpc.FromError(err))
	check(ok, "WatchRun past the end ended with %v", err)
	checkRefused(e, codes.OutOfRange, pb.ErrorReason_RUN_FINISHED)
	check(e.Metadata["last_seq"] == strconv.FormatUint(last.GetSeq(), 10) &&
		e.Metadata["outcome"] == "OUTCOME_OK", "metadata %v", e.Metadata)
	seen := 0
	result, err := r.client.Watch(ctx, last.GetRunId(), last.GetSeq(), func(*pb.RunEvent) error {
		seen++
		return nil
	})
	check(err == nil && result == nil && seen == 0, "watch past the end: %d events, %v", seen, err)
}

type shape struct {
	run  string
	seq  uint64
	kind string
}

func shapes(events []*pb.RunEvent) []shape {
	var out []shape
	for _, e := range events {
		out = append(out, shape{e.GetRunId(), e.GetSeq(), fmt.Sprintf("%T", e.GetKind())})
	}
	return out
}

func (r *runner) idempotent(ctx context.Context, c testCase) {
	call := c.call()
	call.IdempotencyKey = stargrpc.NewIdempotencyKey()
	var first []*pb.RunEvent
	firstDone := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		_, err := r.client.Execute(ctx, call, func(e *pb.RunEvent) error {
			first = append(first, e)
			if len(first) == 1 {
				close(started)
			}
			return nil
		})
		firstDone <- err
	}()
	select {
	case <-started:
	case err := <-firstDone:
		check(false, "the first call ended before its first event: %v", err)
	}
	attached := r.events(ctx, r.client, call)
	err := <-firstDone
	check(err == nil, "%v", err)
	replayed := r.events(ctx, r.client, call)
	checkEndsWithResult(first, pb.Outcome_OUTCOME_OK, nil)
	check(reflect.DeepEqual(shapes(attached), shapes(first)), "the attached call saw other events")
	check(reflect.DeepEqual(shapes(replayed), shapes(first)) &&
		replayed[len(replayed)-1].GetResult().GetOutput() == first[len(first)-1].GetResult().GetOutput(),
		"the replay differs from the run")
	reuse := call
	reuse.ArgumentsJSON = string(c.ReuseArguments)
	checkRefused(r.refusal(ctx, reuse), codes.FailedPrecondition, pb.ErrorReason_IDEMPOTENCY_KEY_REUSED)
}

func (r *runner) clientDeadline(ctx context.Context, c testCase) {
	callCtx, cancel := context.WithTimeout(ctx, time.Duration(c.Deadline*float64(time.Second)))
	defer cancel()
	var events []*pb.RunEvent
	_, err := r.client.Execute(callCtx, c.call(), func(e *pb.RunEvent) error {
		events = append(events, e)
		return nil
	})
	check(len(events) > 0, "no event before the deadline: %v", err)
	if err != nil {
		check(stargrpcCode(err) == codes.DeadlineExceeded, "ended with %v", err)
		runID := events[0].GetRunId()
		events = nil
		_, err = r.client.Watch(ctx, runID, 0, func(e *pb.RunEvent) error {
			events = append(events, e)
			return nil
		})
		check(err == nil, "%v", err)
	}
	checkEndsWithResult(events, pb.Outcome_OUTCOME_TIMEOUT, nil)
	code := events[len(events)-1].GetResult().GetError().GetCode()
	check(stargrpc.ParseReason(code) == pb.ErrorReason_CLIENT_DEADLINE, "code %s", code)
}

func stargrpcCode(err error) codes.Code {
	if e, ok := stargrpc.AsError(err); ok {
		return e.Code
	}
	return codes.Unknown
}

func (r *runner) chunkedFile(ctx context.Context, c testCase) {
	events := r.events(ctx, r.client, c.call())
	checkEndsWithResult(events, pb.Outcome_OUTCOME_OK, nil)
	var data []byte
	chunks, lastFlags := 0, 0
	for _, e := range events {
		chunk := e.GetFileChunk()
		if chunk == nil {
			continue
		}
		check(chunk.GetOffset() == uint64(len(data)), "chunk at %d, expected %d", chunk.GetOffset(), len(data))
		data = append(data, chunk.GetData()...)
		chunks++
		if chunk.GetLast() {
			lastFlags++
			check(lastFlags == 1, "more than one last chunk")
		}
	}
	check(chunks > 1 && lastFlags == 1, "%d chunks, %d marked last", chunks, lastFlags)
	sum := sha256.Sum256(data)
	digest := hex.EncodeToString(sum[:])
	result := events[len(events)-1].GetResult()
	sent := result.GetWriteback().GetSentFiles()
	size := c.intArgument("size")
	check(len(sent) == 1 && sent[0].GetStreamed() && sent[0].GetSize() == uint64(size) && len(data) == size,
		"sent files %v, %d bytes", sent, len(data))
	check(sent[0].GetSha256() == digest && result.GetOutput() == digest, "sha256 differs")
}

func (r *runner) coalesced(ctx context.Context, c testCase) {
	var events []*pb.RunEvent
	_, err := r.client.Execute(ctx, c.call(), func(e *pb.RunEvent) error {
		events = append(events, e)
		if len(events) == 1 {
			time.Sleep(time.Duration(c.Pause * float64(time.Second))) // read slowly at first
		}
		return nil
	})
	check(err == nil, "%v", err)
	var last uint64
	var deltas strings.Builder
	coalesced := false
	for _, e := range events {
		first := e.GetSeq()
		if e.GetFirstSeq() != 0 {
			first, coalesced = e.GetFirstSeq(), true
		}
		check(first == last+1 && e.GetSeq() >= first, "message %d..%d after seq %d", first, e.GetSeq(), last)
		last = e.GetSeq()
		if e.GetStep().GetPhase() == pb.StepPhase_STEP_PHASE_DELTA {
			deltas.WriteString(e.GetStep().GetDelta())
		}
	}
	count := c.intArgument("count")
	var want strings.Builder
	for i := 1; i <= count; i++ {
		fmt.Fprintf(&want, "%d\n", i)
	}
	check(deltas.String() == want.String(), "the delta texts differ")
	check(coalesced, "no message was coalesced")
	checkEndsWithResult(events, pb.Outcome_OUTCOME_OK, text(fmt.Sprintf("burst %d", count)))
}

func (r *runner) bigInteger(ctx context.Context, c testCase) {
	checkEndsWithResult(r.events(ctx, r.client, c.call()), pb.Outcome_OUTCOME_OK, text(c.Output))
}
