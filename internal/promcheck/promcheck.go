// SPDX-License-Identifier: Apache-2.0

// Package promcheck is what the end-to-end tests ask of a running
// Prometheus and of the agent's exposition: which alerts fire, whether
// every query of the shipped Grafana dashboard returns data, and whether
// promtool finds anything to fix on /metrics.
package promcheck

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"sigs.k8s.io/yaml"
)

// API is a Prometheus server's HTTP API.
type API struct {
	Client *http.Client
	URL    string // e.g. http://127.0.0.1:9091
}

// Get decodes the JSON answer to path?q into v.
func (a API) Get(path string, q url.Values, v any) error {
	u := a.URL + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	resp, err := a.Client.Get(u)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", path, resp.Status, bytes.TrimSpace(b))
	}
	return json.Unmarshal(b, v)
}

// Firing returns the labels of each firing alert called name.
func (a API) Firing(name string) ([]map[string]string, error) {
	var alerts struct {
		Data struct {
			Alerts []struct {
				Labels map[string]string `json:"labels"`
				State  string            `json:"state"`
			} `json:"alerts"`
		} `json:"data"`
	}
	if err := a.Get("/api/v1/alerts", nil, &alerts); err != nil {
		return nil, err
	}
	var out []map[string]string
	for _, al := range alerts.Data.Alerts {
		if al.Labels["alertname"] == name && al.State == "firing" {
			out = append(out, al.Labels)
		}
	}
	return out, nil
}

// Series returns how many series an instant query returns.
func (a API) Series(expr string) (int, error) {
	var res struct {
		Status string `json:"status"`
		Data   struct {
			Result []json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := a.Get("/api/v1/query", url.Values{"query": {expr}}, &res); err != nil {
		return 0, err
	}
	if res.Status != "success" {
		return 0, fmt.Errorf("query %s: status %q", expr, res.Status)
	}
	return len(res.Data.Result), nil
}

// Query is one query of a dashboard panel.
type Query struct {
	Panel, Expr string
}

// DashboardQueries reads a Grafana dashboard's panel queries, with its
// variables at "All" and $__rate_interval set to rateInterval (which must
// fit the scrape interval of the Prometheus they go to).
func DashboardQueries(file string, rateInterval time.Duration) ([]Query, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var dash struct {
		Panels     []panel `json:"panels"`
		Templating struct {
			List []struct {
				Name     string `json:"name"`
				Type     string `json:"type"`
				AllValue string `json:"allValue"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	// Every query variable at its "All" value; $__rate_interval last, so
	// no variable's name is a prefix of another's replaced first.
	subst := []string{"$__rate_interval", rateInterval.String()}
	for _, v := range dash.Templating.List {
		if v.Type == "query" {
			subst = append(subst, "$"+v.Name, cmp.Or(v.AllValue, ".*"))
		}
	}
	vars := strings.NewReplacer(subst...)
	var out []Query
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, q := range p.Targets {
				out = append(out, Query{Panel: p.Title, Expr: vars.Replace(q.Expr)})
			}
			walk(p.Panels) // a collapsed row holds its panels
		}
	}
	walk(dash.Panels)
	return out, nil
}

type panel struct {
	Title   string `json:"title"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"`
}

// RateInterval stands for a dashboard's $__rate_interval against a
// Prometheus that scrapes every second: 15 scrapes.
const RateInterval = 15 * time.Second

// CheckDashboard waits until s's scrapes span RateInterval (and 5 s
// more), then runs every query of the Grafana dashboard in file against
// s. It returns how many queries there were and one error for each that
// failed or returned no series; err is for a dashboard it could not read.
func (s *Server) CheckDashboard(file string) (queries int, failed []error, err error) {
	if d := time.Until(s.Started.Add(RateInterval + 5*time.Second)); d > 0 {
		time.Sleep(d)
	}
	qs, err := DashboardQueries(file, RateInterval)
	if err != nil {
		return 0, nil, err
	}
	for _, q := range qs {
		if n, err := s.Series(q.Expr); err != nil || n == 0 {
			failed = append(failed, fmt.Errorf("dashboard panel %q: %s: %d series, %v", q.Panel, q.Expr, n, err))
		}
	}
	return len(qs), failed, nil
}

// Lint runs `promtool check metrics` (from promtool, a path or a name on
// PATH) on an exposition; any complaint is an error.
func Lint(promtool string, exposition []byte) error {
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(exposition)
	out, err := cmd.CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		return fmt.Errorf("promtool check metrics: %v\n%s", err, out)
	}
	return nil
}

// Ready waits up to d for the server to say it is ready.
func (a API) Ready(d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		resp, err := a.Client.Get(a.URL + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("/-/ready: %s", resp.Status)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("prometheus not ready after %v: %w", d, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// ShippedJob reads the shipped scrape job (deploy/monitoring/
// prometheus-scrape.yaml) and points its Kubernetes service discovery at
// an API server from outside the cluster: its address, CA and a bearer
// token file, which a Prometheus in a pod gets from its service account.
func ShippedJob(file, apiServer, caFile, tokenFile string) ([]map[string]any, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var jobs []map[string]any
	if err := yaml.Unmarshal(b, &jobs); err != nil || len(jobs) != 1 {
		return nil, fmt.Errorf("%s: %v, %d jobs (want 1)", file, err, len(jobs))
	}
	sds, _ := jobs[0]["kubernetes_sd_configs"].([]any)
	if len(sds) != 1 {
		return nil, fmt.Errorf("%s: %d kubernetes_sd_configs, want 1", file, len(sds))
	}
	sd, _ := sds[0].(map[string]any)
	if sd == nil {
		return nil, fmt.Errorf("%s: kubernetes_sd_configs[0] is not a map", file)
	}
	sd["api_server"] = apiServer
	sd["tls_config"] = map[string]any{"ca_file": caFile}
	sd["authorization"] = map[string]any{"credentials_file": tokenFile}
	return jobs, nil
}

// Server is a Prometheus a test started.
type Server struct {
	API
	Started time.Time
	cmd     *exec.Cmd
	log     *os.File
}

// Start writes cfg (a prometheus.yml) into dir, checks it with promtool,
// and starts the command newCmd makes for that config and a data
// directory in dir, with its output in dir/prometheus.log; it returns once
// the server at api says it is ready. Stop it with Stop.
func Start(dir string, cfg []byte, promtool string, newCmd func(config, data string) *exec.Cmd, api API) (*Server, error) {
	config := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(config, cfg, 0o600); err != nil {
		return nil, err
	}
	if out, err := exec.Command(promtool, "check", "config", config).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("promtool check config: %v\n%s", err, out)
	}
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		return nil, err
	}
	cmd := newCmd(config, filepath.Join(dir, "data"))
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, err
	}
	s := &Server{API: api, Started: time.Now(), cmd: cmd, log: log}
	if err := api.Ready(30 * time.Second); err != nil {
		return nil, fmt.Errorf("%w\n%s", err, s.Stop())
	}
	return s, nil
}

// Stop ends the server (SIGTERM, SIGKILL after 10 s) and returns the last
// lines of its log.
func (s *Server) Stop() string {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { s.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-done
	}
	s.log.Close()
	b, _ := os.ReadFile(s.log.Name())
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-30):], "\n")
}
