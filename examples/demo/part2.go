// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/penaltybox/penaltybox/pkg/admin"

	"github.com/penaltybox/penaltybox/internal/testnet"
)

// The timeline of part 2, from the start of the load. Phase C lasts until
// b3 has been back for tailAfterRejoin (whole seconds, so every row of
// the table is a full second), at most maxAfterHeal.
const (
	breakAfter      = 3 * time.Second // phase B: b3 refuses every connection
	healAfter       = 8 * time.Second // phase C: b3 serves again
	tailAfterRejoin = 3 * time.Second
	maxAfterHeal    = 20 * time.Second
	pollEvery       = 100 * time.Millisecond
	// stopGrace lets the attempts due before the end finish before the
	// load is stopped (an attempt takes milliseconds here, at most
	// ConnectTimeout+RequestTimeout); attempts due after the end are dropped.
	stopGrace = time.Second
)

// bad is the backend that fails in part 2.
const bad = 3

// endpointsView is GET /admin/endpoints.
type endpointsView admin.EndpointsView

// poll is one look at b3 through /admin/endpoints.
type poll struct {
	at    time.Time
	state string // "" if the poll failed
}

// logEntry is one structured line of the agent's log about b3.
type logEntry struct {
	at     time.Time
	msg    string
	reason string
	raw    string
}

func (d *demo) part2(ctx context.Context) error {
	p := d.p
	o := d.o
	b3 := d.topo.Backend(bad)
	ep := endpoint(bad)
	p.section(fmt.Sprintf("Part 2: a failing backend. Steady load of %.0f new connections/s", o.rate))
	span := func(a, b time.Duration) string { return fmt.Sprintf("%v-%vs", a.Seconds(), b.Seconds()) }
	p.line("  A  %-6s  all three backends serve", span(0, breakAfter))
	p.line("  B  %-6s  b3 refuses every connection (nothing listens: its kernel answers SYN with RST)",
		span(breakAfter, healAfter))
	p.line("             → the agent ejects it after %d consecutive failures, for a penalty of %v ±%.0f%%,",
		maxFailures, minPenalty, 100*jitterRatio)
	p.line("               then lets one real connection through as a probe; a failed probe doubles the penalty")
	p.line("  C  %-6s  b3 is healed → it rejoins after its penalty and one successful probe",
		fmt.Sprintf("%v-…s", healAfter.Seconds()))
	p.line("             (the load stops %v after b3 is back)", tailAfterRejoin)
	p.line("")

	auxCtx, stopAux := context.WithCancel(ctx)
	defer stopAux()
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	var wg sync.WaitGroup

	// Phase switcher.
	var breakAt, healAt time.Time
	var phaseErr error
	t0 := time.Now()
	wg.Add(1)
	go func() {
		defer wg.Done()
		steps := []struct {
			after time.Duration
			mode  testnet.Mode
			at    *time.Time
		}{{breakAfter, testnet.Refuse, &breakAt}, {healAfter, testnet.Serve, &healAt}}
		for _, s := range steps {
			select {
			case <-auxCtx.Done():
				return
			case <-time.After(time.Until(t0.Add(s.after))):
			}
			*s.at = time.Now()
			if err := b3.SetMode(s.mode); err != nil {
				phaseErr = fmt.Errorf("switch b3 to %v: %w", s.mode, err)
				return
			}
		}
	}()

	// Poller: b3's state as an operator sees it in /admin/endpoints. Once
	// it sees b3 ready again after the heal, it ends the load at the next
	// whole second at least tailAfterRejoin later.
	var polls []poll
	end := healAfter + maxAfterHeal // from t0
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(pollEvery)
		defer tick.Stop()
		rejoined := false
		for {
			if rejoined && time.Since(t0) > end+stopGrace {
				stopLoad()
			}
			pctx, cancel := context.WithTimeout(auxCtx, 500*time.Millisecond)
			var v endpointsView
			err := d.agent.JSON(pctx, "/admin/endpoints", &v)
			cancel()
			pl := poll{at: time.Now()}
			if err == nil {
				pl.state = stateOf(v, ep)
			}
			polls = append(polls, pl)
			if !rejoined && pl.state == "ready" && pl.at.Sub(t0) > healAfter {
				rejoined = true
				end = (pl.at.Sub(t0) + tailAfterRejoin + time.Second - 1).Truncate(time.Second)
			}
			select {
			case <-auxCtx.Done():
				return
			case <-tick.C:
			}
		}
	}()

	rs, err := testnet.Load(loadCtx, d.topo.Client, testnet.LoadSpec{
		Target: fmt.Sprintf("%s:%d", testnet.VIP, vipPort), Rate: o.rate, Duration: healAfter + maxAfterHeal,
		// Longer than the client's first SYN retransmission (1s), as
		// clients' connect timeouts are: a refused probe's client is
		// rescued by it (see "Part 2 in numbers").
		ConnectTimeout: 3 * time.Second, RequestTimeout: 2 * time.Second,
	})
	stopAux()
	wg.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("part 2 load: %w", err)
	}
	// Keep the attempts due before the end (all finished: stopGrace).
	if len(rs) > 0 {
		for i, r := range rs {
			if r.Scheduled.Sub(rs[0].Scheduled) >= end {
				rs = rs[:i]
				break
			}
		}
	}
	cut := 0
	for _, r := range rs {
		if errors.Is(r.Err, context.Canceled) {
			cut++
		}
	}
	if cut > 0 {
		d.problem("%d attempts were still running %v after the end of the load and were cut off (counted as failed)", cut, stopGrace)
	}
	if phaseErr != nil {
		return phaseErr
	}
	if len(rs) == 0 || healAt.IsZero() {
		return errors.New("part 2: the load ended before b3 was healed")
	}
	base := rs[0].Scheduled
	rel := func(t time.Time) string { return fmt.Sprintf("%.2fs", t.Sub(base).Seconds()) }

	// The per-second table.
	buckets := rs.Buckets(time.Second)
	t := p.table()
	t.row("SEC", "PHASE", "ATTEMPTS", "OK", "OK %", "B1", "B2", "B3", "FAILED", "B3 STATE (/admin/endpoints, every 100ms)")
	for i, b := range buckets {
		phase := "A healthy"
		switch {
		case b.Start >= healAfter:
			phase = "C b3 healed"
		case b.Start >= breakAfter:
			phase = "B b3 refuses"
		}
		failed := 0
		for c, n := range b.Counts {
			if c.Failed() {
				failed += n
			}
		}
		lo, hi := base.Add(b.Start), base.Add(b.Start+b.Width)
		t.row(fmt.Sprintf("%d-%d", i, i+1), phase, b.Total, b.Counts[testnet.OK], pct(b.Counts[testnet.OK], b.Total),
			b.ByBackend["b1"], b.ByBackend["b2"], b.ByBackend["b3"], failed, statesIn(polls, lo, hi))
	}
	t.flush()
	p.line("  (seconds are when connections were scheduled; OK = connected and got the backend's HTTP answer)")

	// What happened, from the agent's log and the clients' results.
	logs, err := d.b3Log(ep)
	if err != nil {
		return err
	}
	var ejectAt, readyAt time.Time
	var ejectLine *logEntry
	probesFailed := 0
	for i := range logs {
		l := &logs[i]
		switch {
		case l.msg == "endpoint ejected" && l.reason == "consecutive-failures" && ejectAt.IsZero():
			ejectAt, ejectLine = l.at, l
		case l.msg == "endpoint ejected" && l.reason == "probe-failed" && l.at.Before(healAt):
			probesFailed++
		case l.msg == "endpoint ready" && l.at.After(healAt) && readyAt.IsZero():
			readyAt = l.at
		}
	}
	var firstFail time.Time
	before, after, afterOK := 0, 0, 0
	for _, r := range rs {
		if r.Class.Failed() && (firstFail.IsZero() || r.End().Before(firstFail)) {
			firstFail = r.End()
		}
		if ejectAt.IsZero() {
			continue
		}
		if r.Class.Failed() && r.Started.Before(ejectAt) {
			before++
		}
		if !r.Started.Before(ejectAt) && r.Started.Before(healAt) {
			after++
			if r.Class == testnet.OK {
				afterOK++
			}
		}
	}
	var firstServed time.Time
	for _, r := range rs {
		if r.Backend == b3.Name && r.Started.After(healAt) {
			firstServed = r.Started
			break
		}
	}

	p.section("Part 2 in numbers")
	if firstFail.IsZero() {
		p.line("  b3 started refusing at %s; no client connection failed.", rel(breakAt))
	} else {
		p.line("  b3 started refusing at %s; the clients saw the first refused connection at %s.", rel(breakAt), rel(firstFail))
	}
	if ejectAt.IsZero() {
		d.problem("b3 was never ejected")
	} else {
		cf := ejectLine.fields()["consecutive_failures"]
		pen := fmt.Sprint(ejectLine.fields()["penalty"])
		if pd, err := time.ParseDuration(pen); err == nil {
			pen = pd.Round(10 * time.Millisecond).String()
		}
		p.line("  Ejected at %s: %s after the first failure, after %d failed connections",
			rel(ejectAt), ms(ejectAt.Sub(firstFail)), before)
		p.line("    (the agent counted %v consecutive failures; first penalty %v).", cf, pen)
		p.line("  From the ejection until the heal: %d of %d connections succeeded (%s).",
			afterOK, after, pct(afterOK, after))
		if f := after - afterOK; f == 0 && probesFailed > 0 {
			p.line("    %s of the still-refusing b3 failed (a failed probe doubles the penalty), and no client saw it:",
				plural(probesFailed, "probe"))
			p.line("    the datapath kept b3's RST from the probe's client, whose SYN retransmission (~1s later) went to another backend.")
		} else if f > 0 {
			other := ""
			if f > probesFailed {
				other = fmt.Sprintf("; %s other (e.g. already on its way to b3)", plural(f-probesFailed, "connection"))
			}
			p.line("    Failed there: %s, %s of the still-refusing b3 (a failed probe doubles the penalty)%s.",
				plural(f, "connection"), plural(probesFailed, "probe"), other)
		}
		if after > 0 && float64(afterOK) < 0.99*float64(after) {
			d.problem("only %s of the connections after the ejection succeeded", pct(afterOK, after))
		}
	}
	p.line("  b3 was healed at %s.", rel(healAt))
	if readyAt.IsZero() {
		d.problem("b3 did not rejoin (no \"endpoint ready\" after the heal)")
	} else {
		p.line("  It rejoined (probe succeeded → ready) at %s, %.2fs after the heal, when its penalty was over;",
			rel(readyAt), readyAt.Sub(healAt).Seconds())
	}
	if firstServed.IsZero() {
		d.problem("b3 served no connection after it was healed")
	} else {
		p.line("    its first connection after the heal started at %s, and it took its share again.", rel(firstServed))
	}
	total := rs.Count(testnet.OK)
	var byClass []string
	counts := rs.Counts()
	for _, c := range testnet.Classes {
		if c != testnet.OK && counts[c] > 0 {
			byClass = append(byClass, fmt.Sprintf("%d %s", counts[c], c))
		}
	}
	failedText := "none failed"
	if len(byClass) > 0 {
		failedText = "failed: " + strings.Join(byClass, ", ")
	}
	p.line("  Overall: %d of %d connections succeeded (%s); %s.", total, len(rs), pct(total, len(rs)), failedText)

	m, err := d.agent.Metrics(ctx)
	if err != nil {
		return fmt.Errorf("scrape the agent's /metrics: %w", err)
	}
	p.line("")
	p.line("  The agent's metrics for b3 (/metrics):")
	t = p.table()
	t.row(fmt.Sprintf("penaltybox_endpoint_ejections_total{backend=%q}", ep),
		num(m.Get("penaltybox_endpoint_ejections_total", "backend", ep)))
	for _, r := range []string{"success", "failure", "inconclusive"} {
		t.row(fmt.Sprintf("penaltybox_endpoint_probes_total{backend=%q,result=%q}", ep, r),
			num(m.Get("penaltybox_endpoint_probes_total", "backend", ep, "result", r)))
	}
	t.row("penaltybox_datapath_probe_flows_total (probes the kernel admitted)", num(m.Get("penaltybox_datapath_probe_flows_total")))
	t.row(fmt.Sprintf("penaltybox_endpoint_failures_by_kind_total{backend=%q,kind=\"refused\"}", ep),
		num(m.Get("penaltybox_endpoint_failures_by_kind_total", "backend", ep, "kind", "refused")))
	t.row(fmt.Sprintf("penaltybox_endpoint_ejected{backend=%q} (1: out of rotation)", ep),
		num(m.Get("penaltybox_endpoint_ejected", "backend", ep)))
	if n, sum, ok := histogram(m, "penaltybox_ejection_reaction_seconds"); ok {
		t.row("penaltybox_ejection_reaction_seconds_count", n)
		t.row("penaltybox_ejection_reaction_seconds_sum", fmt.Sprintf("%.6f", sum))
		if n > 0 {
			t.row("  → mean: kernel saw the failure → b3 out of the Maglev table", us(sum/float64(n)))
		}
	}
	t.row("penaltybox_datapath_events_lost_total", num(m.Get("penaltybox_datapath_events_lost_total")))
	t.flush()
	if m.Get("penaltybox_endpoint_ejected", "backend", ep) != 0 {
		d.problem("b3 ends out of rotation, want ready")
	}

	p.line("")
	p.line("  The agent's log lines about b3 (grep '\"msg\":\"endpoint (ejected|probation|ready)\"' %s):", d.agent.LogPath())
	if len(logs) == 0 {
		p.line("    (none)")
	}
	for _, l := range logs {
		p.line("  t=%-6s %s", rel(l.at), l.raw)
	}
	return nil
}

// stateOf returns ep's state in an /admin/endpoints view.
func stateOf(v endpointsView, ep string) string {
	for _, s := range v.Services {
		for _, e := range s.Endpoints {
			if e.Endpoint == ep {
				return e.State
			}
		}
	}
	return "absent"
}

// statesIn summarises the states polled in [lo, hi): each change once,
// in order ("ready→ejected").
func statesIn(polls []poll, lo, hi time.Time) string {
	var seq []string
	for _, pl := range polls {
		if pl.at.Before(lo) || !pl.at.Before(hi) {
			continue
		}
		s := pl.state
		if s == "" {
			s = "?"
		}
		if len(seq) == 0 || seq[len(seq)-1] != s {
			seq = append(seq, s)
		}
	}
	if len(seq) == 0 {
		return "-"
	}
	return strings.Join(seq, "→")
}

// b3Log returns the agent's "endpoint ejected|probation|ready" log lines
// about ep, in order.
func (d *demo) b3Log(ep string) ([]logEntry, error) {
	f, err := os.Open(d.agent.LogPath())
	if err != nil {
		return nil, fmt.Errorf("read the agent's log: %w", err)
	}
	defer f.Close()
	var out []logEntry
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		var rec struct {
			Time     time.Time `json:"time"`
			Msg      string    `json:"msg"`
			Endpoint string    `json:"endpoint"`
			Reason   string    `json:"reason"`
		}
		if json.Unmarshal([]byte(line), &rec) != nil {
			continue
		}
		switch rec.Msg {
		case "endpoint ejected", "endpoint probation", "endpoint ready":
		default:
			continue
		}
		if !strings.Contains(rec.Endpoint, ep) {
			continue
		}
		out = append(out, logEntry{at: rec.Time, msg: rec.Msg, reason: rec.Reason, raw: line})
	}
	return out, sc.Err()
}

func (l *logEntry) fields() map[string]any {
	m := map[string]any{}
	json.Unmarshal([]byte(l.raw), &m)
	return m
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func ms(d time.Duration) string { return fmt.Sprintf("%dms", d.Round(time.Millisecond).Milliseconds()) }

func us(sec float64) string {
	if sec < 1e-3 {
		return fmt.Sprintf("%.0fµs", sec*1e6)
	}
	return fmt.Sprintf("%.2fms", sec*1e3)
}
