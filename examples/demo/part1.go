// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// part1 sends new connections through the VIP and shows how Maglev spread
// them, as the clients saw it and as the agent counts it.
func (d *demo) part1(ctx context.Context) error {
	p := d.p
	o := d.o
	p.section(fmt.Sprintf("Part 1: spread. %d new connections at %.0f/s from the client to %s:%d",
		o.part1N, o.part1Rate, testnet.VIP, vipPort))
	p.line("  Each connection sends one HTTP request; the backend's answer names it.")
	p.line("")
	rs, err := testnet.Load(ctx, d.topo.Client, testnet.LoadSpec{
		Target: fmt.Sprintf("%s:%d", testnet.VIP, vipPort), Rate: o.part1Rate, Count: o.part1N,
		ConnectTimeout: time.Second, RequestTimeout: 2 * time.Second,
	})
	if err != nil {
		return fmt.Errorf("part 1 load: %w", err)
	}
	by := rs.ByBackend()
	t := p.table()
	t.row("BACKEND", "ENDPOINT", "CONNECTIONS", "SHARE")
	for _, b := range d.topo.Backends {
		t.row(b.Name, endpoint(b.Index), by[b.Name], pct(by[b.Name], len(rs)))
	}
	if f := len(rs) - rs.Count(testnet.OK); f > 0 {
		t.row("failed", "", f, pct(f, len(rs)))
	}
	t.row("total", "", len(rs), "")
	t.flush()
	if f := len(rs) - rs.Count(testnet.OK); f > 0 {
		d.problem("%d of %d connections failed with all backends healthy: %v", f, len(rs), rs)
	}
	for _, b := range d.topo.Backends {
		if by[b.Name] == 0 {
			d.problem("backend %s got no connection", b.Name)
		}
	}

	// Outcome events reach the agent through a ring buffer, a moment
	// after the client is done: let the last ones land before scraping.
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(300 * time.Millisecond):
	}
	m, err := d.agent.Metrics(ctx)
	if err != nil {
		return fmt.Errorf("scrape the agent's /metrics: %w", err)
	}
	p.line("")
	p.line("  The agent's counters (from /metrics, read from the datapath's BPF maps and the ring buffer):")
	t = p.table()
	for _, s := range allSeries(m, "penaltybox_service_flows_total") {
		t.row(s.name("penaltybox_service_flows_total", "svc_name"), num(s.value))
	}
	for _, s := range allSeries(m, "penaltybox_backend_flows_total") {
		t.row(s.name("penaltybox_backend_flows_total", "backend"), num(s.value))
	}
	var zero []string
	for _, s := range allSeries(m, "penaltybox_events_total") {
		if s.value == 0 {
			zero = append(zero, s.labels["type"])
			continue
		}
		t.row(s.name("penaltybox_events_total", "type"), num(s.value))
	}
	t.row("penaltybox_datapath_events_lost_total", num(m.Get("penaltybox_datapath_events_lost_total")))
	t.row(`penaltybox_endpoints{state="ready"}`, num(m.Get("penaltybox_endpoints", "svc_name", service, "state", "ready")))
	t.flush()
	if len(zero) > 0 {
		p.line("  (penaltybox_events_total is 0 for type %s)", strings.Join(zero, ", "))
	}
	if lost := m.Get("penaltybox_datapath_events_lost_total"); lost != 0 {
		d.problem("the datapath lost %v outcome events", lost)
	}
	if got := m.Get("penaltybox_service_flows_total", "svc_name", service); got < float64(len(rs)) {
		d.problem("penaltybox_service_flows_total = %v, fewer than the %d connections sent", got, len(rs))
	}
	return nil
}
