// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"net/netip"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/outcomes"
)

// BenchmarkHealthyConnection is the agent's decision work for one
// connection that succeeds: the events the datapath reports for it
// (new flow, established, first data, end) through classification,
// accrual and the counters, as HandleEvents gets them in one batch. The
// ring buffer read and decode are outcomes.BenchmarkDecode's.
func BenchmarkHealthyConnection(b *testing.B) {
	e := newEnv(b)
	s := web(80, 3, settings())
	e.start(state(s))
	svc, be := e.ids(s)
	var tmpl [3][4]outcomes.Event
	for j := range tmpl {
		for k, typ := range []outcomes.Type{outcomes.NewFlow, outcomes.Established, outcomes.FirstData, outcomes.FlowEnd} {
			tmpl[j][k] = e.event(typ, svc, be[j], 0, 0)
		}
	}
	batch := make([]outcomes.Event, 4)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		c := netip.AddrPortFrom(client, uint16(i))
		copy(batch, tmpl[i%3][:])
		for k := range batch {
			batch[k].Client = c
		}
		e.a.HandleEvents(batch)
	}
}
