// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// A service's series exist at 0 once it is added, carry the service's
// three labels, and count what Inc counts: what the CounterVec children
// the agent made at 0 for each programmed service showed.
func TestServiceCountersExposition(t *testing.T) {
	m := New(nil, nil, nil)
	m.KernelTrips.Add("shop/web:http")
	m.KernelTrips.Inc("shop/web:http/ipv6", "undone") // added by its first count
	m.KernelTrips.Inc("shop/web:http/ipv6", "undone")
	m.FlowsToEjected.Add("shop/web:http")
	m.FlowsToEjected.Add("dns")
	m.FlowsToEjected.Inc("dns")
	m.FlowsToEjected.Add("dns") // again: keeps its count
	want := `
# HELP penaltybox_kernel_trips_total ` + help(t, m.KernelTrips) + `
# TYPE penaltybox_kernel_trips_total counter
penaltybox_kernel_trips_total{result="adopted",svc_name="web",svc_namespace="shop",svc_port="http"} 0
penaltybox_kernel_trips_total{result="adopted",svc_name="web",svc_namespace="shop",svc_port="http/ipv6"} 0
penaltybox_kernel_trips_total{result="undone",svc_name="web",svc_namespace="shop",svc_port="http"} 0
penaltybox_kernel_trips_total{result="undone",svc_name="web",svc_namespace="shop",svc_port="http/ipv6"} 2
# HELP penaltybox_new_flows_to_ejected_total ` + help(t, m.FlowsToEjected) + `
# TYPE penaltybox_new_flows_to_ejected_total counter
penaltybox_new_flows_to_ejected_total{svc_name="dns",svc_namespace="",svc_port=""} 1
penaltybox_new_flows_to_ejected_total{svc_name="web",svc_namespace="shop",svc_port="http"} 0
`
	if err := testutil.GatherAndCompare(m.Registry, strings.NewReader(want),
		"penaltybox_kernel_trips_total", "penaltybox_new_flows_to_ejected_total"); err != nil {
		t.Fatal(err)
	}
	if got := m.KernelTrips.Get("shop/web:http/ipv6", "undone"); got != 2 {
		t.Errorf("Get = %v, want 2", got)
	}
	if got := m.KernelTrips.Get("unknown", "adopted"); got != 0 || m.KernelTrips.Len() != 2 {
		t.Errorf("Get of an unknown service = %v (and %d services), want 0 and nothing added", got, m.KernelTrips.Len())
	}
}

func help(t *testing.T, c prometheus.Collector) string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 1)
	c.Describe(ch)
	s := (<-ch).String()
	_, rest, _ := strings.Cut(s, `help: "`)
	h, _, ok := strings.Cut(rest, `", `)
	if !ok {
		t.Fatalf("no help in %s", s)
	}
	return strings.ReplaceAll(h, `\"`, `"`)
}

// A label value the counter does not declare is a programming error, as a
// wrong number of labels is for a CounterVec.
func TestServiceCountersRejectUndeclaredValues(t *testing.T) {
	m := New(nil, nil, nil)
	for name, f := range map[string]func(){
		"unknown value":   func() { m.KernelTrips.Inc("web", "kept") },
		"missing value":   func() { m.KernelTrips.Inc("web") },
		"value too many":  func() { m.FlowsToEjected.Inc("web", "adopted") },
		"two values":      func() { m.KernelTrips.Inc("web", "adopted", "undone") },
		"label no values": func() { NewServiceCounters(prometheus.CounterOpts{Name: "x_total"}, "result") },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
	if m.KernelTrips.Len() != 0 || m.FlowsToEjected.Len() != 0 {
		t.Error("a rejected count added its service")
	}
}

// The three series of each of 10,000 services take about 1.6 MB,
// not the 21 MB their CounterVec children hold.
func TestServiceCountersAreSmall(t *testing.T) {
	m := New(nil, nil, nil)
	names := make([]string, 10_000)
	for i := range names {
		names[i] = fmt.Sprintf("bench/svc-%d:http", i)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for _, n := range names {
		m.FlowsToEjected.Add(n)
		m.KernelTrips.Add(n)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if got := int64(after.HeapAlloc) - int64(before.HeapAlloc); got > 4<<20 {
		t.Errorf("3 series of %d services hold %d kB, want at most 4 MB", len(names), got>>10)
	}
	runtime.KeepAlive(m)
}
