// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/inspect"
)

// `agent inspect` reads the pinned maps: with the agent running, and
// after it was killed, it shows the service, the refusing endpoint ejected
// (datapath and accrual), its penalty running down, the healthy endpoints
// holding every table slot, and their counters.
func TestInspectReadsThePinnedState(t *testing.T) {
	e := newEnv(t, 3)
	if err := e.topo.Backend(3).SetMode(testnet.Refuse); err != nil {
		t.Fatal(err)
	}
	// A long penalty: b3 stays ejected (no probe) for the whole test.
	e.startAgent(config(e.topo, all(3), `    maxInflight: 50
    retryRefused: false
    failureAccrual:
      maxFailures: 5
      minPenalty: 60s
      maxPenalty: 60s
      jitterRatio: 0
      connectTimeout: 300ms
`))
	rs, err := testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{Target: testnet.VIP + ":80",
		Rate: 100, Count: 100, ConnectOnly: true, ConnectTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if rs.Count(testnet.OK) < 90 {
		t.Fatalf("load: %v", rs)
	}
	deadline := time.Now().Add(5 * time.Second)
	for st, _ := e.state(b3); st != "ejected"; st, _ = e.state(b3) {
		if time.Now().After(deadline) {
			t.Fatalf("b3 %s, want ejected", st)
		}
		time.Sleep(20 * time.Millisecond)
	}

	running := e.inspect(t)
	check := func(when string, r *inspect.Report) {
		t.Helper()
		if len(r.Services) != 1 {
			t.Fatalf("%s: %d services, want 1", when, len(r.Services))
		}
		s := r.Services[0]
		if s.VIP != testnet.VIP+":80" || s.Protocol != "tcp" || s.MaxInflight != 50 || len(s.Endpoints) != 3 {
			t.Fatalf("%s: service %+v", when, s)
		}
		if s.KernelTrips == nil || s.KernelTrips.MaxFailures != maxFailures || s.KernelTrips.Trips != 1 {
			t.Errorf("%s: kernel trips %+v, want 1 at maxFailures %d", when, s.KernelTrips, maxFailures)
		}
		slots := 0
		var flows uint64
		for _, ep := range s.Endpoints {
			slots += ep.Slots
			flows += ep.Counters.Flows
			if ep.Addr == b3 {
				if ep.Datapath != "ejected" || ep.Accrual.State != "ejected" || !ep.Accrual.Recorded ||
					ep.Accrual.Ejections != 1 || ep.Slots != 0 || ep.Accrual.LastFailureKind != "refused" {
					t.Errorf("%s: b3 %+v, want ejected in the datapath and by accrual, no slot, one ejection for refusals", when, ep)
				}
				if left, err := time.ParseDuration(ep.Accrual.PenaltyLeft); err != nil || left <= 0 || left > time.Minute {
					t.Errorf("%s: b3's penalty left %q, want within the 60 s penalty", when, ep.Accrual.PenaltyLeft)
				}
				continue
			}
			if ep.Datapath != "active" || ep.Accrual.State != "ready" || ep.Slots == 0 || ep.Counters.Flows == 0 {
				t.Errorf("%s: %s %+v, want active, ready, in the table, with flows", when, ep.Addr, ep)
			}
		}
		if slots != int(s.TableSize) || flows < uint64(rs.Count(testnet.OK)) {
			t.Errorf("%s: %d of %d slots held, %d flows counted for %d connections", when, slots, s.TableSize, flows, rs.Count(testnet.OK))
		}
	}
	check("agent running", running)

	// Gone: killed, its pins left behind. inspect reads the same state.
	if err := e.agent.Kill(); err != nil {
		t.Fatal(err)
	}
	gone := e.inspect(t)
	check("agent killed", gone)
	left := func(r *inspect.Report) time.Duration {
		for _, ep := range r.Services[0].Endpoints {
			if ep.Addr == b3 {
				d, _ := time.ParseDuration(ep.Accrual.PenaltyLeft)
				return d
			}
		}
		return 0
	}
	l0, l1 := left(running), left(gone)
	if l1 > l0 {
		t.Errorf("penalty left grew from %v to %v", l0, l1)
	}

	// The human form names the endpoint and its states.
	out, err := exec.Command(agentBin, "inspect", "--bpffs-root", e.agent.BPFFSRoot).CombinedOutput()
	if err != nil {
		t.Fatalf("agent inspect: %v\n%s", err, out)
	}
	t.Logf("agent inspect:\n%s", out)
	var line string
	for l := range strings.Lines(string(out)) {
		if strings.Contains(l, b3) {
			line = l
		}
	}
	if f := strings.Fields(line); len(f) < 3 || f[1] != "ejected" || f[2] != "ejected" {
		t.Errorf("b3's line %q, want its datapath and accrual states ejected", line)
	}

	// With only the DaemonSet's capabilities, as `kubectl exec ds/... --
	// agent inspect` has them: everything but the tables' slots.
	caps := daemonSetCaps(t)
	out, err = exec.Command("setpriv", "--bounding-set=-all,"+caps, "--inh-caps=-all",
		agentBin, "inspect", "--json", "--bpffs-root", e.agent.BPFFSRoot).Output()
	if err != nil {
		t.Fatalf("agent inspect with %s: %v", caps, err)
	}
	var limited inspect.Report
	if err := json.Unmarshal(out, &limited); err != nil {
		t.Fatal(err)
	}
	if s := limited.Services[0]; s.TableUnread == "" || len(s.Endpoints) != 3 || left(&limited) <= 0 {
		t.Errorf("with %s: service %+v, want everything but the table read", caps, s)
	}

	// Where nothing is pinned, it says so.
	out, err = exec.Command(agentBin, "inspect", "--bpffs-root", t.TempDir()).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "no penaltybox datapath pinned") {
		t.Errorf("inspect of an empty directory: %v, %s", err, out)
	}
}

// inspect runs `agent inspect --json` on the agent's pins.
func (e *env) inspect(t *testing.T) *inspect.Report {
	t.Helper()
	out, err := exec.Command(agentBin, "inspect", "--json", "--bpffs-root", e.agent.BPFFSRoot).Output()
	if err != nil {
		t.Fatalf("agent inspect --json: %v", err)
	}
	var r inspect.Report
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("agent inspect --json: %v\n%s", err, out)
	}
	return &r
}

// daemonSetCaps is the capability list deploy/daemonset.yaml adds, in
// setpriv's spelling ("+bpf,+net_admin,...").
func daemonSetCaps(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../deploy/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var ds struct {
		Spec struct {
			Template struct {
				Spec struct {
					Containers []struct {
						SecurityContext struct {
							Capabilities struct {
								Add []string `json:"add"`
							} `json:"capabilities"`
						} `json:"securityContext"`
					} `json:"containers"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(b, &ds); err != nil || len(ds.Spec.Template.Spec.Containers) == 0 {
		t.Fatalf("daemonset.yaml: %v", err)
	}
	var out []string
	for _, c := range ds.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add {
		out = append(out, "+"+strings.ToLower(strings.TrimPrefix(c, "CAP_")))
	}
	if len(out) == 0 {
		t.Fatal("daemonset.yaml adds no capability")
	}
	return strings.Join(out, ",")
}
