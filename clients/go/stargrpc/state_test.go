package stargrpc

import (
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/stargrpc/stargrpc/clients/go/stargrpcv1"
)

func TestParseStateScopeNamesEachScopeWithWhatItNeeds(t *testing.T) {
	cases := []struct {
		name, runID, principal string
		want                   *pb.StateScopeRef
	}{
		{"run", "r1", "", &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_RUN, RunId: "r1"}},
		{"tree", "root", "", &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_TREE, RunId: "root"}},
		{"principal", "", "alice", &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_PRINCIPAL, Principal: "alice"}},
		{"global", "", "", &pb.StateScopeRef{Scope: pb.StateScope_STATE_SCOPE_GLOBAL}},
	}
	for _, c := range cases {
		got, err := ParseStateScope(c.name, c.runID, c.principal)
		if err != nil || !proto.Equal(got, c.want) {
			t.Errorf("ParseStateScope(%q, %q, %q) = %v, %v", c.name, c.runID, c.principal, got, err)
		}
	}
	for _, bad := range [][3]string{{"run", "", ""}, {"tree", "", "x"}, {"principal", "r1", ""},
		{"planet", "", ""}, {"", "", ""}, {"RUN", "r1", ""}} {
		if got, err := ParseStateScope(bad[0], bad[1], bad[2]); err == nil {
			t.Errorf("ParseStateScope(%q) = %v, want an error", bad, got)
		}
	}
}
