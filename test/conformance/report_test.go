// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/penaltybox/penaltybox/internal/clusterrig"
)

// specResult is one spec of Ginkgo's JSON report (--report-complete-ginkgo
// writes <report-dir>/ginkgo/report.json).
type specResult struct {
	Name       string // container texts and the spec's own, as --ginkgo.focus matches them
	State      string // passed, failed, skipped, panicked, timedout, interrupted, aborted, pending
	RunTime    time.Duration
	Message    string   // the failure's, or the skip's
	Namespaces []string // the test namespaces the framework made for it
}

// filtered: not selected by the focus (Ginkgo reports those as skipped,
// with no message and no run time).
func (s specResult) filtered() bool {
	return s.State == "skipped" && s.Message == "" && s.RunTime == 0
}

var nsDestroyed = regexp.MustCompile(`Destroying namespace \\?"([a-z0-9][a-z0-9-]*)\\?" for this suite`)

func readReport(path string) ([]specResult, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return parseReport(b)
}

func parseReport(b []byte) ([]specResult, error) {
	var reports []struct {
		SpecReports []json.RawMessage
	}
	if err := json.Unmarshal(b, &reports); err != nil {
		return nil, fmt.Errorf("ginkgo report: %w", err)
	}
	var out []specResult
	for _, r := range reports {
		for _, raw := range r.SpecReports {
			var s struct {
				ContainerHierarchyTexts []string
				LeafNodeType            string
				LeafNodeText            string
				State                   string
				RunTime                 time.Duration
				Failure                 struct{ Message string }
			}
			if err := json.Unmarshal(raw, &s); err != nil {
				return nil, fmt.Errorf("ginkgo report: %w", err)
			}
			if s.LeafNodeType != "It" {
				continue // suite-level nodes (BeforeSuite, ReportAfterSuite, ...)
			}
			res := specResult{
				Name:    strings.Join(append(s.ContainerHierarchyTexts, s.LeafNodeText), " "),
				State:   s.State,
				RunTime: s.RunTime,
				Message: s.Failure.Message,
			}
			seen := map[string]bool{}
			for _, m := range nsDestroyed.FindAllSubmatch(raw, -1) {
				if ns := string(m[1]); !seen[ns] {
					seen[ns] = true
					res.Namespaces = append(res.Namespaces, ns)
				}
			}
			out = append(out, res)
		}
	}
	return out, nil
}

// serviceLog is what the agent's metrics said about each penaltybox
// service (namespace/name:port) while the tests ran: the most new flows
// it had admitted, and why it served it. A Service's series go when the
// Service does, so the log keeps the largest value each one reached.
type serviceLog struct {
	mu      sync.Mutex
	flows   map[string]float64
	reasons map[string]map[string]bool
	scrapes int
}

func newServiceLog() *serviceLog {
	return &serviceLog{flows: map[string]float64{}, reasons: map[string]map[string]bool{}}
}

// scrape reads the agent's /metrics (the node's address: the agent's pod
// has the host's network) every 100 ms until ctx ends: some specs connect
// twice and delete their Service a few milliseconds later, and a Service's
// series go with it. It fails only
// when no scrape at all succeeded.
func (l *serviceLog) scrape(ctx context.Context, rig *clusterrig.Rig) error {
	c := rig.HTTPClient()
	url := "http://" + net.JoinHostPort(clusterrig.NodeIP, "9464") + "/metrics"
	var lastErr error
	for {
		if err := l.scrapeOnce(ctx, c, url); err != nil {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.scrapes == 0 {
				return fmt.Errorf("no successful scrape of %s: %v", url, lastErr)
			}
			return nil
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (l *serviceLog) scrapeOnce(ctx context.Context, c *http.Client, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return l.add(string(b))
}

// add records one scrape's text.
func (l *serviceLog) add(text string) error {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.scrapes++
	if f := fams["penaltybox_service_flows_total"]; f != nil {
		for _, m := range f.GetMetric() {
			svc := serviceName(m.GetLabel())
			v := m.GetCounter().GetValue()
			if m.GetCounter() == nil {
				v = m.GetGauge().GetValue()
			}
			if v > l.flows[svc] {
				l.flows[svc] = v
			}
		}
	}
	if f := fams["penaltybox_service_served"]; f != nil {
		for _, m := range f.GetMetric() {
			if m.GetGauge().GetValue() != 1 {
				continue
			}
			svc := serviceName(m.GetLabel())
			if l.reasons[svc] == nil {
				l.reasons[svc] = map[string]bool{}
			}
			l.reasons[svc][labelValue(m.GetLabel(), "reason")] = true
		}
	}
	return nil
}

type servedInfo struct {
	names       []string // the penaltybox services of the namespaces
	notScopeAll []string // those served for another reason as well
}

// forNamespaces sums the flows of the services of the namespaces nss.
func (l *serviceLog) forNamespaces(nss []string) (float64, servedInfo) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var total float64
	var info servedInfo
	in := func(svc string) bool {
		for _, ns := range nss {
			if strings.HasPrefix(svc, ns+"/") {
				return true
			}
		}
		return false
	}
	for svc, reasons := range l.reasons {
		if !in(svc) {
			continue
		}
		info.names = append(info.names, svc)
		for r := range reasons {
			if r != "scope-all" {
				info.notScopeAll = append(info.notScopeAll, svc+" ("+r+")")
			}
		}
	}
	for svc, v := range l.flows {
		if in(svc) {
			total += v
		}
	}
	sort.Strings(info.names)
	sort.Strings(info.notScopeAll)
	return total, info
}

func (l *serviceLog) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.reasons)
}

func (l *serviceLog) withFlows() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, v := range l.flows {
		if v > 0 {
			n++
		}
	}
	return n
}

// serviceName is the penaltybox service a series is about, as its labels
// spell it (svc_namespace, svc_name, svc_port: "ns/name:port"; a
// standalone service has only svc_name).
func serviceName(pairs []*dto.LabelPair) string {
	ns, name, port := labelValue(pairs, "svc_namespace"), labelValue(pairs, "svc_name"), labelValue(pairs, "svc_port")
	if ns == "" {
		return name
	}
	return ns + "/" + name + ":" + port
}

func labelValue(pairs []*dto.LabelPair, name string) string {
	for _, p := range pairs {
		if p.GetName() == name {
			return p.GetValue()
		}
	}
	return ""
}

// save writes what the log saw, for reading after the run.
func (l *serviceLog) save(path string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	type svc struct {
		Flows   float64  `json:"flows"`
		Reasons []string `json:"reasons"`
	}
	out := map[string]*svc{}
	for name, reasons := range l.reasons {
		s := &svc{Flows: l.flows[name]}
		for r := range reasons {
			s.Reasons = append(s.Reasons, r)
		}
		sort.Strings(s.Reasons)
		out[name] = s
	}
	for name, v := range l.flows {
		if out[name] == nil {
			out[name] = &svc{Flows: v}
		}
	}
	b, err := json.MarshalIndent(map[string]any{"scrapes": l.scrapes, "services": out}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}
