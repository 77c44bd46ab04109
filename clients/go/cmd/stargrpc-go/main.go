// Command stargrpc-go is a small command line on the Go client: list the tools, call one,
// watch a run, steer, cancel, approve or deny a run; open, list and close sessions; read
// and change run state (admin role).
//
//	stargrpc-go [-target HOST:PORT] [-api-key KEY] [-json] tools
//	stargrpc-go call [-session ID] [-lane NAME] [-priority N] [-max-wait SECONDS] TOOL [ARGS_JSON]
//	stargrpc-go watch [-after-seq N] RUN_ID
//	stargrpc-go cancel [-reason TEXT] RUN_ID
//	stargrpc-go steer RUN_ID MESSAGE
//	stargrpc-go approve|deny -approval-id ID [-reason TEXT] [-arguments-digest SHA256] RUN_ID
//	stargrpc-go session create [python|shell] | session list | session close ID
//	stargrpc-go state get|delete -scope S [-run ID] [-principal ID] KEY
//	stargrpc-go state set -scope S [-run ID] [-principal ID] [-ttl SECONDS] KEY JSON
//	stargrpc-go state list -scope S [-run ID] [-principal ID] [-prefix P] [-values] [-limit N] [-after KEY]
//
// The target and key default to $STARGRPC_TARGET (else localhost:50051) and
// $STARGRPC_API_KEY. `call` prints "run <id>" on stderr and exits 0 only for OUTCOME_OK
// (1 otherwise); Ctrl-C cancels the run and exits 130. `watch` past the end of a finished
// run exits 0 with nothing to show. `cancel` exits 0 when the run was going, 2 when it had
// ended. `session create` prints the new session's id. `state` works as `stargrpc state`:
// get prints the value's JSON, get and delete exit 3 when the key is absent, list prints a
// key a line (KEY<TAB>JSON with -values) and where the next page starts on stderr. A
// refusal prints the status, its reason, each field violation and the server's retry
// delay (a LANE_BUSY refusal's estimated wait), and exits 1.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/stargrpc/stargrpc/clients/go/stargrpc"
	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

const usage = `usage: stargrpc-go [-target HOST:PORT] [-api-key KEY] [-json] COMMAND
  tools                          the catalog
  call [-session ID] [-lane NAME] [-priority N] [-max-wait SECONDS] TOOL [ARGS_JSON]
                                 run a tool (in a session), print its events; a call
                                 that waits in its lane's queue shows a QUEUED notice
  watch [-after-seq N] RUN_ID    replay a run after a seq, then follow it
  cancel [-reason TEXT] RUN_ID   stop a run
  steer RUN_ID MESSAGE           send a running tool a message
  approve|deny -approval-id ID [-reason TEXT] [-arguments-digest SHA256] RUN_ID
                                 decide on a run that waits for approval
  session create [python|shell]  open a session, print its id
  session list                   the caller's open sessions
  session close ID               close a session
  state get|delete -scope S [-run ID] [-principal ID] KEY
  state set -scope S [-run ID] [-principal ID] [-ttl SECONDS] KEY JSON
  state list -scope S [-run ID] [-principal ID] [-prefix P] [-values] [-limit N] [-after KEY]
                                 run state (admin role); S: run, tree, principal, global
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	global := flag.NewFlagSet("stargrpc-go", flag.ContinueOnError)
	global.SetOutput(stderr)
	global.Usage = func() { fmt.Fprint(stderr, usage) }
	target := global.String("target", envOr("STARGRPC_TARGET", "localhost:50051"), "server address")
	apiKey := global.String("api-key", os.Getenv("STARGRPC_API_KEY"), "API key or JWT")
	asJSON := global.Bool("json", false, "print events as proto3 JSON lines")
	if err := global.Parse(args); err != nil {
		return exitUsage(err)
	}
	rest := global.Args()
	if len(rest) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	client, err := stargrpc.Dial(*target, stargrpc.Options{APIKey: *apiKey})
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	defer client.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	out := &printer{w: stdout, json: *asJSON}

	command, params := rest[0], rest[1:]
	action := "" // session and state: the word after the command, before its flags
	if (command == "session" || command == "state") && len(params) > 0 {
		action, params = params[0], params[1:]
	}
	sub := flag.NewFlagSet(command, flag.ContinueOnError)
	sub.SetOutput(stderr)
	afterSeq := sub.Uint64("after-seq", 0, "watch: replay the events after this seq")
	reason := sub.String("reason", "", "cancel, approve, deny: why, shown in the Result")
	approvalID := sub.String("approval-id", "", "approve, deny: the approval id of the request")
	digest := sub.String("arguments-digest", "", "approve, deny: the arguments' sha256 shown")
	parentRunID := sub.String("parent-run-id", "", "call: hang the run under this run of yours")
	sessionID := sub.String("session", "", "call: run in this session of yours")
	lane := sub.String("lane", "", "call: run in this lane (needs the server's lane_override_role)")
	priority := sub.Int("priority", 0, "call: priority in the lane's queue (0: the default)")
	maxWait := sub.Float64("max-wait", 0, "call: refuse (LANE_BUSY) rather than wait longer (seconds; 0 waits)")
	scope := sub.String("scope", "", "state: run, tree, principal or global")
	runID := sub.String("run", "", "state: the run (scope run) or the tree's root run (scope tree)")
	principal := sub.String("principal", "", "state: the principal's id (scope principal)")
	ttl := sub.Float64("ttl", 0, "state set: seconds the entry lives (0: as long as the scope)")
	prefix := sub.String("prefix", "", "state list: only keys starting with this")
	withValues := sub.Bool("values", false, "state list: print each value too")
	limit := sub.Int("limit", 100, "state list: keys per page (1..1000)")
	afterKey := sub.String("after", "", "state list: go on after this key")
	if err := sub.Parse(params); err != nil {
		return exitUsage(err)
	}
	params = sub.Args()

	switch {
	case command == "tools" && len(params) == 0:
		reply, err := client.ListTools(ctx)
		if err != nil {
			return fail(stderr, err)
		}
		if *asJSON {
			fmt.Fprintln(stdout, protojson.Format(reply))
			return 0
		}
		for _, tool := range reply.GetTools() {
			mark := ""
			if tool.GetPermissions().GetPrivileged() {
				mark = " [privileged]"
			}
			fmt.Fprintf(stdout, "%s%s  %s\n", tool.GetName(), mark, tool.GetDescription())
		}
		return 0
	case command == "call" && (len(params) == 1 || len(params) == 2):
		if *priority < math.MinInt32 || *priority > math.MaxInt32 {
			fmt.Fprintln(stderr, "call: -priority is out of range")
			return 2
		}
		call := stargrpc.Call{Tool: params[0], ParentRunID: *parentRunID, SessionID: *sessionID,
			Lane: *lane, Priority: int32(*priority), MaxWaitSeconds: *maxWait}
		if len(params) == 2 {
			call.ArgumentsJSON = params[1]
		}
		announced := false
		result, err := client.Execute(ctx, call, func(event *pb.RunEvent) error {
			if !announced {
				fmt.Fprintf(stderr, "run %s\n", event.GetRunId())
				announced = true
			}
			return out.event(event)
		})
		if ctx.Err() != nil {
			fmt.Fprintf(stderr, "interrupted: %v\n", err)
			return 130
		}
		if err != nil {
			return fail(stderr, err)
		}
		if result.GetResult().GetOutcome() != pb.Outcome_OUTCOME_OK {
			return 1
		}
		return 0
	case command == "watch" && len(params) == 1:
		result, err := client.Watch(ctx, params[0], *afterSeq, out.event)
		if ctx.Err() != nil {
			return 130
		}
		if err != nil {
			return fail(stderr, err)
		}
		if result == nil {
			fmt.Fprintf(stderr, "run %s has ended: nothing follows seq %d\n", params[0], *afterSeq)
		}
		return 0
	case command == "cancel" && len(params) == 1:
		cancelled, err := client.Cancel(ctx, params[0], *reason)
		if err != nil {
			return fail(stderr, err)
		}
		if !cancelled {
			fmt.Fprintln(stderr, "already ended")
			return 2
		}
		fmt.Fprintln(stderr, "cancelled")
		return 0
	case (command == "approve" || command == "deny") && len(params) == 1:
		reply, err := client.Approve(ctx, params[0], *approvalID, stargrpc.Decision{
			Deny: command == "deny", Reason: *reason, ArgumentsDigest: *digest,
		})
		if err != nil {
			return fail(stderr, err)
		}
		verb := "approved"
		if command == "deny" {
			verb = "denied"
		}
		fmt.Fprintf(stderr, "%s run %s\n", verb, reply.GetRunId())
		return 0
	case command == "session":
		return sessionCommand(ctx, client, action, params, *asJSON, stdout, stderr)
	case command == "state":
		ref, err := stargrpc.ParseStateScope(*scope, *runID, *principal)
		if err != nil {
			fmt.Fprintf(stderr, "state: %v\n", err)
			return 2
		}
		page := stargrpc.StatePage{Prefix: *prefix, AfterKey: *afterKey, WithValues: *withValues}
		if *limit < 1 || *limit > 1000 || *ttl < 0 {
			fmt.Fprintln(stderr, "state: -limit is 1..1000, -ttl a number of seconds >= 0")
			return 2
		}
		page.PageSize = int32(*limit)
		return stateCommand(ctx, client, action, params, ref, page,
			time.Duration(*ttl*float64(time.Second)), stdout, stderr)
	case command == "steer" && len(params) == 2:
		if err := client.Steer(ctx, params[0], params[1]); err != nil {
			return fail(stderr, err)
		}
		fmt.Fprintln(stderr, "steered")
		return 0
	}
	fmt.Fprint(stderr, usage)
	return 2
}

// sessionCommand runs `session create|list|close`; the exit status.
func sessionCommand(ctx context.Context, client *stargrpc.Client, action string, params []string,
	asJSON bool, stdout, stderr io.Writer) int {
	switch {
	case action == "create" && len(params) <= 1:
		kind := "python"
		if len(params) == 1 {
			kind = params[0]
		}
		session, err := client.CreateSession(ctx, kind, stargrpc.SessionLimits{})
		if err != nil {
			return fail(stderr, err)
		}
		if asJSON {
			return printJSON(stdout, stderr, session)
		}
		fmt.Fprintln(stdout, session.GetSessionId())
		return 0
	case action == "list" && len(params) == 0:
		sessions, err := client.ListSessions(ctx)
		if err != nil {
			return fail(stderr, err)
		}
		for _, session := range sessions {
			if asJSON {
				if code := printJSON(stdout, stderr, session); code != 0 {
					return code
				}
				continue
			}
			busy := "idle"
			if session.GetBusy() {
				busy = "busy"
			}
			fmt.Fprintf(stdout, "%s  %s  %s  %d calls\n", session.GetSessionId(),
				session.GetKind(), busy, session.GetCalls())
		}
		return 0
	case action == "close" && len(params) == 1:
		if err := client.CloseSession(ctx, params[0]); err != nil {
			return fail(stderr, err)
		}
		fmt.Fprintln(stderr, "closed")
		return 0
	}
	fmt.Fprint(stderr, usage)
	return 2
}

// stateCommand runs `state get|set|delete|list` on one scope; the exit status.
func stateCommand(ctx context.Context, client *stargrpc.Client, action string, params []string,
	ref *pb.StateScopeRef, page stargrpc.StatePage, ttl time.Duration, stdout, stderr io.Writer) int {
	switch {
	case action == "get" && len(params) == 1:
		value, found, err := client.GetState(ctx, ref, params[0])
		if err != nil {
			return fail(stderr, err)
		}
		if !found {
			fmt.Fprintf(stderr, "%s: absent\n", params[0])
			return 3
		}
		fmt.Fprintln(stdout, value)
		return 0
	case action == "set" && len(params) == 2:
		if !json.Valid([]byte(params[1])) {
			fmt.Fprintf(stderr, "state set: VALUE is not JSON; quote a string as '\"text\"'\n")
			return 2
		}
		// The text goes as written, so a large integer keeps every digit.
		if err := client.SetState(ctx, ref, params[0], params[1], ttl); err != nil {
			return fail(stderr, err)
		}
		return 0
	case action == "delete" && len(params) == 1:
		deleted, err := client.DeleteState(ctx, ref, params[0])
		if err != nil {
			return fail(stderr, err)
		}
		if !deleted {
			fmt.Fprintf(stderr, "%s: absent\n", params[0])
			return 3
		}
		return 0
	case action == "list" && len(params) == 0:
		reply, err := client.ListState(ctx, ref, page)
		if err != nil {
			return fail(stderr, err)
		}
		for _, entry := range reply.GetEntries() {
			if page.WithValues {
				fmt.Fprintf(stdout, "%s\t%s\n", entry.GetKey(), entry.GetValueJson())
			} else {
				fmt.Fprintln(stdout, entry.GetKey())
			}
		}
		if next := reply.GetNextAfterKey(); next != "" {
			fmt.Fprintf(stderr, "more: -after %s\n", next)
		}
		return 0
	}
	fmt.Fprint(stderr, usage)
	return 2
}

// printJSON prints a message as one proto3 JSON line (proto field names); the exit status.
func printJSON(stdout, stderr io.Writer, message proto.Message) int {
	text, err := jsonLine.Marshal(message)
	if err != nil {
		return fail(stderr, err)
	}
	fmt.Fprintln(stdout, string(text))
	return 0
}

func envOr(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

func exitUsage(err error) int {
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	return 2
}

func fail(stderr io.Writer, err error) int {
	fmt.Fprintln(stderr, err)
	var refusal *stargrpc.Error
	if errors.As(err, &refusal) && refusal.HasRetryDelay {
		fmt.Fprintf(stderr, "  retry after %gs\n", refusal.RetryDelay.Seconds())
	}
	return 1
}

// printer shows events as text (deltas as they come, then "= OUTCOME" and the output
// when it was not streamed) or as proto3 JSON lines.
type printer struct {
	w        io.Writer
	json     bool
	streamed bool
	midLine  bool // the last delta did not end its line
}

var jsonLine = protojson.MarshalOptions{UseProtoNames: true}

func (p *printer) event(event *pb.RunEvent) error {
	if p.json {
		text, err := jsonLine.Marshal(event)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(p.w, string(text))
		return err
	}
	if step := event.GetStep(); step != nil && step.GetPhase() == pb.StepPhase_STEP_PHASE_DELTA {
		p.streamed = true
		delta := step.GetDelta()
		if delta != "" {
			p.midLine = !strings.HasSuffix(delta, "\n")
		}
		_, err := fmt.Fprint(p.w, delta)
		return err
	}
	if result := event.GetResult(); result != nil {
		if p.midLine { // the summary starts on a line of its own
			fmt.Fprintln(p.w)
			p.midLine = false
		}
		if usage := result.GetUsage(); usage != nil {
			fmt.Fprintln(p.w, usageLine(usage)) // the receipt, just above the outcome
		}
		line := "= " + strings.TrimPrefix(result.GetOutcome().String(), "OUTCOME_")
		if e := result.GetError(); e != nil {
			line += fmt.Sprintf(" [%s] %s", e.GetCode(), e.GetMessage())
		}
		fmt.Fprintln(p.w, line)
		if !p.streamed && result.GetOutput() != "" {
			fmt.Fprintln(p.w, result.GetOutput())
		}
	}
	return nil
}

// usageLine is the run's receipt (Result.usage) on one line, as `stargrpc call` prints it:
// what was measured, nothing for what was not (an unset optional field is nil).
func usageLine(u *pb.Usage) string {
	var parts []string
	if u.WallSeconds != nil {
		parts = append(parts, "wall "+seconds(u.GetWallSeconds()))
	}
	if u.GetQueuedSeconds() != 0 {
		parts = append(parts, "queued "+seconds(u.GetQueuedSeconds()))
	}
	if u.CpuUserSeconds != nil || u.CpuSystemSeconds != nil {
		user, system := u.GetCpuUserSeconds(), u.GetCpuSystemSeconds()
		parts = append(parts, fmt.Sprintf("cpu %s (%s user + %s system)",
			seconds(user+system), seconds(user), seconds(system)))
	}
	if u.PeakRssBytes != nil {
		parts = append(parts, "peak memory "+size(u.GetPeakRssBytes()))
	}
	if u.BytesWritten != nil {
		parts = append(parts, "wrote "+size(u.GetBytesWritten()))
	}
	if u.NetworkBytesSent != nil || u.NetworkBytesReceived != nil {
		parts = append(parts, fmt.Sprintf("network %s sent, %s received",
			size(u.GetNetworkBytesSent()), size(u.GetNetworkBytesReceived())))
	}
	if u.GetChildRuns() != 0 {
		parts = append(parts, fmt.Sprintf("%d child runs", u.GetChildRuns()))
	}
	return "usage: " + strings.Join(parts, ", ")
}

// seconds is a duration for people, as `stargrpc call` shows it: 1.50s; under 10 ms in ms
// (0.4ms), which two decimals of a second would show as 0.00s.
func seconds(value float64) string {
	switch {
	case !(value > 0):
		return "0s"
	case value < 0.01:
		return fmt.Sprintf("%.1fms", value*1000)
	}
	return fmt.Sprintf("%.2fs", value)
}

// size is a byte count for people: 512 B, 12.0 KiB, 58.0 MiB, 1.5 GiB.
func size(count uint64) string {
	if count < 1024 {
		return fmt.Sprintf("%d B", count)
	}
	value, unit := float64(count), ""
	for _, unit = range []string{"KiB", "MiB", "GiB"} {
		value /= 1024
		if value < 1024 {
			break
		}
	}
	return fmt.Sprintf("%.1f %s", value, unit)
}
