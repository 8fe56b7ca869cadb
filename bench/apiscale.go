// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/agentrun"
	"github.com/penaltybox/penaltybox/internal/kubeapi"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// apiscaleOpts size the control plane at scale against a real API server.
type apiscaleOpts struct {
	Rounds, Services, PerService int
	// Rate EndpointSlice changes per second, for ChangeFor.
	Rate      int
	ChangeFor time.Duration
	// Idle is how long the agent's CPU is measured with nothing changing,
	// before the changes.
	Idle time.Duration
	// LogDir, when set, keeps each round's agent log (--agent-logs).
	LogDir string
}

const apiscaleNS = "bench"

// daemonSetMemory is deploy/daemonset.yaml's memory limit (1Gi), which it
// gives the agent as GOMEMLIMIT.
const daemonSetMemory = 1 << 30

// apiscaleBackend is endpoint j of service i (198.18.0.0/15; unique within
// a service, the port tells services apart).
func apiscaleBackend(i, j int) (addr string, port int32) {
	return fmt.Sprintf("198.18.%d.%d", 16+j, i&255), int32(8080 + i>>8)
}

// apiscaleNew is the address that replaces endpoint 0 at change k.
func apiscaleNew(k int) string { return fmt.Sprintf("198.18.%d.%d", 200+(k>>8)%50, k&255) }

func ptr[T any](v T) *T { return &v }

// apiscaleCluster is the API server with the bench's Services and slices.
type apiscaleCluster struct {
	srv    *kubeapi.Server
	client kubernetes.Interface
	vips   []netip.Addr // by service index
	slices []*discoveryv1.EndpointSlice
}

func runAPIScale(res *Results, o apiscaleOpts, agentBin string, logf func(string, ...any)) error {
	root, err := agentrun.ModuleRoot()
	if err != nil {
		return err
	}
	tools, err := kubeapi.Tools(root, "k8s-tools.sh")
	if err != nil {
		return err
	}
	// The agent holds a handle on Maglev tables it made (up to two per
	// Service), so it needs many open files. A DaemonSet's container gets
	// the runtime's limit (containerd: 2^20); here the agent inherits the
	// bench's, raised alike where the bench may.
	var lim unix.Rlimit
	if err := raiseNoFile(1 << 20); err != nil {
		logf("apiscale: %v (the agent makes do)", err)
	}
	unix.Getrlimit(unix.RLIMIT_NOFILE, &lim)
	res.note("apiscale", "Open files (RLIMIT_NOFILE) the agent inherits in this run: %d (soft), %d (hard).", lim.Cur, lim.Max)
	r, err := newRig(agentBin, 1)
	if err != nil {
		return err
	}
	defer r.close()
	apiDir := filepath.Join(r.dir, "apiserver")
	if err := os.MkdirAll(apiDir, 0o700); err != nil {
		return err
	}
	t0 := time.Now()
	srv, err := kubeapi.Start(context.Background(), r.topo.Node, kubeapi.Options{Tools: tools, Dir: apiDir})
	if err != nil {
		return err
	}
	defer func() {
		if err := srv.Stop(); err != nil {
			logf("apiscale: %v", err)
		}
	}()
	unregister := atInterrupt(func() { srv.Stop() })
	defer unregister()
	logf("apiscale: etcd and kube-apiserver ready in %v", time.Since(t0).Round(time.Millisecond))

	cfg := srv.RestConfig(srv.AdminToken)
	cfg.QPS, cfg.Burst = 1e6, 1e6 // the bench's own writes: no client-side throttle
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	c := &apiscaleCluster{srv: srv, client: client}
	t0 = time.Now()
	if err := c.populate(o, logf); err != nil {
		return err
	}
	logf("apiscale: %d Services and EndpointSlices (%d endpoints each) created in %v",
		o.Services, o.PerService, time.Since(t0).Round(time.Millisecond))

	label := fmt.Sprintf("%d Services × %d endpoints", o.Services, o.PerService)
	add := func(name, unit string, v float64, digits int) {
		f := res.figure("apiscale", name, unit)
		f.Samples = append(f.Samples, v)
		f.Digits = digits
	}
	change := 0 // the changes made so far, over rounds: each a new address
	for round := range o.Rounds {
		m, err := c.round(r, o, round, &change, logf)
		if err != nil {
			return fmt.Errorf("round %d: %w", round+1, err)
		}
		add(label+": agent start → every Service's table in the maps", "s", m.programmed.Seconds(), 2)
		add(label+": agent start → /readyz 200", "s", m.ready.Seconds(), 2)
		add(label+": agent CPU, start → programmed and ready (utime+stime)", "s", m.startCPU, 2)
		add(label+": kube-apiserver + etcd CPU meanwhile", "s", m.startServerCPU, 2)
		add(label+": agent RSS when programmed (VmRSS)", "MB", m.rss, 1)
		add(label+": agent peak RSS while programming (VmHWM)", "MB", m.hwmStart, 1)
		add(label+": agent peak RSS at the end of the round (VmHWM)", "MB", m.hwmEnd, 1)
		add("agent CPU, idle (no API changes)", "% of a core", m.idleCPU, 2)
		add(fmt.Sprintf("agent CPU, %d EndpointSlice changes/s", o.Rate), "% of a core", m.cpu, 2)
		add(fmt.Sprintf("kube-apiserver + etcd CPU, %d EndpointSlice changes/s", o.Rate), "% of a core", m.serverCPU, 1)
		add("EndpointSlice changes made (rate reached)", "/s", m.rate, 1)
		add("change: API write → new endpoint in the Service's Maglev table, p50", "ms", m.p50, 1)
		add("change: API write → new endpoint in the Service's Maglev table, p99", "ms", m.p99, 1)
		add("change: API write → new endpoint in the Service's Maglev table, max", "ms", m.max, 1)
		add("change: API write returned, p99", "ms", m.writeP99, 1)
		logf("apiscale: round %d/%d: programmed in %v (ready %v; CPU %.2f s, servers %.2f s), RSS %.0f MB (peak %.0f, %.0f at end); idle CPU %.2f%%; %d changes at %.1f/s: agent CPU %.2f%% of a core, servers %.0f%%, latency p50 %.1f ms p99 %.1f ms max %.1f ms",
			round+1, o.Rounds, m.programmed.Round(time.Millisecond), m.ready.Round(time.Millisecond), m.startCPU, m.startServerCPU, m.rss, m.hwmStart, m.hwmEnd,
			m.idleCPU, m.changes, m.rate, m.cpu, m.serverCPU, m.p50, m.p99, m.max)
	}
	res.note("apiscale", "A real etcd %s and kube-apiserver (the end-to-end tests' servers: internal/kubeapi, built by scripts/k8s-tools.sh) in the node namespace of a testnet topology. %s created through the API before the rounds: one TCP port 80 each (ClusterIPs the API server allocates in 198.19.0.0/16) and one EndpointSlice of %d ready endpoints (198.18.16-25.x, a port per 256 Services), both as a cluster's are: the Service with labels and a selector, the slice as the EndpointSlice controller writes it (the Service's labels copied, its owner reference, the trigger-time annotation; each endpoint's pod reference, node, zone and three conditions), so the agent's memory is measured on what real clusters send it. Each round starts a fresh agent (own bpffs, `--scope all`, XDP on the node's interfaces, the admin's kubeconfig, `--backend-metrics=basic` and GOMEMLIMIT=1Gi as deploy/daemonset.yaml runs it) and polls the pinned pb_services map (batch reads) every 10 ms until every bench Service has an entry with a Maglev table; a sample of 20 Services is then checked slot by slot (tableProbe: every endpoint in the table). The start's CPU is the agent's utime+stime from /proc/PID/stat once it is programmed and ready, the verifier's included, and kube-apiserver's plus etcd's over the same window. RSS from /proc/PID/status. The agent holds a handle on each of its Maglev tables (two per Service; reaching a table by id would need CAP_SYS_ADMIN), so it needs more than 20,000 open files here: the bench raises RLIMIT_NOFILE to 2^20 (containerd gives containers that much) and the agent inherits it.", "v3.7.3", label, o.PerService)
	res.note("apiscale", "Changes: %d EndpointSlice updates per second for %v, each to a different Service (its first endpoint replaced by a new address; 4 writers pace the writes). Latency runs from just before the Update call to the moment the Service's table, read through the pinned maps (its pb_services entry polled every ms; once it changed, the table slot by slot), holds the new endpoint and not the old. Agent CPU is utime+stime from /proc/PID/stat over the window, as a share of one core; idle CPU is the same over %v with nothing changing, before.", o.Rate, o.ChangeFor, o.Idle)
	res.target("apiscale", label+" programmed from cold ≤ 2 s (start → every table in the maps)", res.median("apiscale", label+": agent start → every Service's table in the maps"), 2, true, "%.2f s")
	res.target("apiscale", label+": agent RSS ≤ 150 MB (peak, VmHWM)", res.median("apiscale", label+": agent peak RSS at the end of the round (VmHWM)"), 150, true, "%.1f MB")
	res.target("apiscale", fmt.Sprintf("%d EndpointSlice changes/s: agent < 5%% of a core", o.Rate), res.median("apiscale", fmt.Sprintf("agent CPU, %d EndpointSlice changes/s", o.Rate)), 5, true, "%.2f%%")
	res.target("apiscale", "each change in the maps within 100 ms, p99", res.median("apiscale", "change: API write → new endpoint in the Service's Maglev table, p99"), 100, true, "%.1f ms")
	return nil
}

// populate creates the namespace, the Services and their slices.
func (c *apiscaleCluster) populate(o apiscaleOpts, logf func(string, ...any)) error {
	ctx := context.Background()
	for _, ns := range []string{apiscaleNS, "penaltybox-system"} {
		if _, err := c.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	c.vips = make([]netip.Addr, o.Services)
	c.slices = make([]*discoveryv1.EndpointSlice, o.Services)
	return parallel(16, o.Services, func(i int) error {
		name := fmt.Sprintf("svc%05d", i)
		labels := map[string]string{"app": name, "app.kubernetes.io/part-of": "bench"}
		svc, err := c.client.CoreV1().Services(apiscaleNS).Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
			Spec: corev1.ServiceSpec{
				Ports:    []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}},
				Selector: map[string]string{"app": name},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		vip, err := netip.ParseAddr(svc.Spec.ClusterIP)
		if err != nil {
			return fmt.Errorf("service %s: cluster IP %q: %w", name, svc.Spec.ClusterIP, err)
		}
		_, port := apiscaleBackend(i, 0)
		// As the EndpointSlice controller writes a slice: its labels (the
		// Service's copied), trigger-time annotation and owner, and each
		// endpoint's pod, node, zone and three conditions. What the agent
		// keeps of it is its choice; what it receives is a real one.
		sliceLabels := map[string]string{discoveryv1.LabelServiceName: name, discoveryv1.LabelManagedBy: "endpointslice-controller.k8s.io"}
		for k, v := range labels {
			sliceLabels[k] = v
		}
		sl := &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%05x", name, i*7919%0xfffff), GenerateName: name + "-",
				Labels:          sliceLabels,
				Annotations:     map[string]string{corev1.EndpointsLastChangeTriggerTime: time.Now().UTC().Format(time.RFC3339)},
				OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: name, UID: svc.UID, Controller: ptr(true), BlockOwnerDeletion: ptr(true)}}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(port), Protocol: ptr(corev1.ProtocolTCP)}},
		}
		for j := range o.PerService {
			a, _ := apiscaleBackend(i, j)
			pod := fmt.Sprintf("%s-%08x-%05x", name, i*2654435761%0xffffffff, j*40503%0xfffff)
			sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{Addresses: []string{a},
				Conditions: discoveryv1.EndpointConditions{Ready: ptr(true), Serving: ptr(true), Terminating: ptr(false)},
				TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: apiscaleNS, Name: pod, UID: types.UID(fmt.Sprintf("%08x-0000-4000-8000-%012x", i, j))},
				NodeName:   ptr(fmt.Sprintf("node-%03d", (i*o.PerService+j)%50)),
				Zone:       ptr(fmt.Sprintf("zone-%c", 'a'+(i*o.PerService+j)%3))})
		}
		sl, err = c.client.DiscoveryV1().EndpointSlices(apiscaleNS).Create(ctx, sl, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		c.vips[i], c.slices[i] = vip, sl
		if (i+1)%2000 == 0 {
			logf("apiscale: %d Services created", i+1)
		}
		return nil
	})
}

// raiseNoFile raises this process's RLIMIT_NOFILE (soft and hard) to at
// least n; processes it starts inherit it.
func raiseNoFile(n uint64) error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	if lim.Max >= n && lim.Cur >= n {
		return nil
	}
	lim.Cur, lim.Max = max(lim.Cur, n), max(lim.Max, n)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("raise RLIMIT_NOFILE to %d: %w", n, err)
	}
	return nil
}

// parallel runs f(0..n-1) on workers goroutines; the first error stops it.
func parallel(workers, n int, f func(i int) error) error {
	var (
		mu   sync.Mutex
		next int
		errs []error
		wg   sync.WaitGroup
	)
	for range workers {
		wg.Go(func() {
			for {
				mu.Lock()
				i := next
				next++
				stop := len(errs) > 0
				mu.Unlock()
				if i >= n || stop {
					return
				}
				if err := f(i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

type apiscaleRound struct {
	programmed, ready     time.Duration
	startCPU              float64 // s: the agent's, to programmed and ready
	startServerCPU        float64 // s: kube-apiserver's and etcd's meanwhile
	rss, hwmStart, hwmEnd float64 // MB
	idleCPU, cpu          float64 // % of a core
	serverCPU             float64
	changes               int
	rate                  float64
	p50, p99, max         float64 // ms
	writeP99              float64
}

func (c *apiscaleCluster) round(r *rig, o apiscaleOpts, round int, change *int, logf func(string, ...any)) (m apiscaleRound, err error) {
	dir, err := os.MkdirTemp(r.dir, "apiscale-")
	if err != nil {
		return m, err
	}
	a, err := agentrun.New(r.agent, r.topo.Node, dir, "")
	if err != nil {
		return m, err
	}
	unregister := atInterrupt(func() { a.Close() })
	defer unregister()
	defer func() {
		if cerr := a.Close(); cerr != nil && err == nil {
			err = cerr
		}
		if o.LogDir != "" {
			if cerr := copyFile(a.LogPath(), filepath.Join(o.LogDir, fmt.Sprintf("apiscale-%d.log", round))); cerr != nil && err == nil {
				err = cerr
			}
		}
	}()
	// As deploy/daemonset.yaml runs it: the default series per backend,
	// and the container's memory limit as the Go soft limit (GOMEMLIMIT,
	// which the agent's environment carries: the bench's own runtime read
	// it at its start, unset).
	a.Args = []string{"--node-name", "bench-node", "--kubeconfig", c.srv.AdminKubeconfig, "--scope", "all",
		"--node-interfaces", strings.Join(r.topo.NodeIfaces(), ","), "--pod-interfaces", "",
		"--fleet-evidence=false", "--kube-proxy-metrics-addr", "", "--backend-metrics=basic"}
	if old, had := os.LookupEnv("GOMEMLIMIT"); had {
		defer os.Setenv("GOMEMLIMIT", old)
	} else {
		defer os.Unsetenv("GOMEMLIMIT")
	}
	os.Setenv("GOMEMLIMIT", strconv.Itoa(daemonSetMemory))
	want := map[[16]byte]bool{}
	for _, v := range c.vips {
		want[maps.Addr16(v)] = true
	}

	apiPID, etcdPID := c.srv.PIDs()
	servers0 := procCPU(apiPID) + procCPU(etcdPID)
	t0 := time.Now()
	if err := a.StartNoWait(); err != nil {
		return m, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	var svcs *ebpf.Map
	defer func() {
		if svcs != nil {
			svcs.Close()
		}
	}()
	for m.programmed == 0 || m.ready == 0 {
		if m.ready == 0 {
			if code, _, err := a.Get(ctx, "/readyz"); err == nil && code == 200 {
				m.ready = time.Since(t0)
			}
		}
		if m.programmed == 0 {
			if svcs == nil {
				svcs, _ = ebpf.LoadPinnedMap(filepath.Join(a.BPFFSRoot, bpf.LbMapPbServices), nil)
			}
			if svcs != nil {
				n, err := countProgrammed(svcs, want)
				if err != nil {
					return m, err
				}
				if n == len(want) {
					m.programmed = time.Since(t0)
				}
			}
		}
		if exited, err := a.Exited(0); exited {
			return m, fmt.Errorf("agent exited (%v):\n%s", err, a.LogTail(30))
		}
		select {
		case <-ctx.Done():
			return m, fmt.Errorf("not programmed in time:\n%s", a.LogTail(30))
		case <-time.After(10 * time.Millisecond):
		}
	}
	pid, err := procByArg(a.Binary, a.BPFFSRoot)
	if err != nil {
		return m, err
	}
	// The start's CPU, once programmed and ready (the verifier's
	// included): it moves much less with the machine's other load than
	// the start's duration does.
	m.startCPU = procCPU(pid).Seconds()
	m.startServerCPU = (procCPU(apiPID) + procCPU(etcdPID) - servers0).Seconds()
	rss, _ := procStatusKB(pid, "VmRSS")
	hwm, _ := procStatusKB(pid, "VmHWM")
	m.rss, m.hwmStart = rss/1024, hwm/1024

	p, err := openProbe(a.BPFFSRoot)
	if err != nil {
		return m, err
	}
	defer p.close()
	for k := range 20 {
		i := k * (len(c.vips) / 20)
		have, err := p.addrs(c.vips[i])
		if err != nil {
			return m, fmt.Errorf("service %d (%v): %w", i, c.vips[i], err)
		}
		for _, ep := range c.slices[i].Endpoints {
			ap := netip.AddrPortFrom(netip.MustParseAddr(ep.Addresses[0]), uint16(*c.slices[i].Ports[0].Port))
			if !have[ap] {
				return m, fmt.Errorf("service %d (%v): endpoint %v not in its table %v", i, c.vips[i], ap, have)
			}
		}
	}

	// Idle.
	cpu0 := procCPU(pid)
	i0 := time.Now()
	time.Sleep(o.Idle)
	cpu1 := procCPU(pid)
	m.idleCPU = 100 * (cpu1 - cpu0).Seconds() / time.Since(i0).Seconds()

	// Changes.
	lat, writes, elapsed, cpu, serverCPU, err := c.changes(p, pid, o, change)
	if err != nil {
		return m, fmt.Errorf("changes: %w\n%s", err, a.LogTail(10))
	}
	m.cpu = 100 * cpu.Seconds() / elapsed.Seconds()
	m.serverCPU = 100 * serverCPU.Seconds() / elapsed.Seconds()
	m.changes = len(lat)
	m.rate = float64(len(lat)) / elapsed.Seconds()
	m.p50, m.p99, m.max = pct(lat, 50), pct(lat, 99), pct(lat, 100)
	m.writeP99 = pct(writes, 99)
	hwm, _ = procStatusKB(pid, "VmHWM")
	m.hwmEnd = hwm / 1024
	return m, nil
}

// countProgrammed counts the entries of pb_services for want's VIPs, port
// 80/tcp, that have a Maglev table.
func countProgrammed(svcs *ebpf.Map, want map[[16]byte]bool) (int, error) {
	const chunk = 4096
	ks := make([]bpf.LbSvcKey, chunk)
	vs := make([]bpf.LbSvcValue, chunk)
	n := 0
	var cursor ebpf.MapBatchCursor
	for {
		got, err := svcs.BatchLookup(&cursor, ks, vs, nil)
		for i := range got {
			if want[ks[i].Vip.Bytes] && ks[i].Port == maps.Port(80) && ks[i].Proto == 6 && vs[i].TableSize > 0 {
				n++
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// pending is one change not yet seen in the maps.
type pending struct {
	i        int
	old, new netip.AddrPort
	before   bpf.LbSvcValue
	t0       time.Time
	changed  bool // the service entry changed: check the table
}

// changes updates Rate slices a second for ChangeFor and returns, per
// change, the latency to the maps and of the write, in ms.
func (c *apiscaleCluster) changes(p *tableProbe, pid int, o apiscaleOpts, change *int) (lat, writes []float64, elapsed, cpu, serverCPU time.Duration, err error) {
	total := int(float64(o.Rate) * o.ChangeFor.Seconds())
	// Services in a stride over all of them: none changes twice in a
	// round (a stride prime to their count).
	stride := 7919
	for gcd(stride, len(c.vips)) != 1 {
		stride++
	}
	var (
		mu      sync.Mutex
		waiting []*pending
		werrs   []error
	)
	jobs := make(chan int, total)
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for k := range jobs {
				i := (k * stride) % len(c.vips)
				sl := c.slices[i].DeepCopy()
				port := uint16(*sl.Ports[0].Port)
				old := netip.AddrPortFrom(netip.MustParseAddr(sl.Endpoints[0].Addresses[0]), port)
				newA := apiscaleNew(*change + k)
				sl.Endpoints[0].Addresses = []string{newA}
				pd := &pending{i: i, old: old, new: netip.AddrPortFrom(netip.MustParseAddr(newA), port)}
				if err := p.service(c.vips[i], &pd.before); err != nil {
					mu.Lock()
					werrs = append(werrs, fmt.Errorf("service %d (%v): pb_services before its change: %w", i, c.vips[i], err))
					mu.Unlock()
					continue
				}
				pd.t0 = time.Now()
				got, err := c.client.DiscoveryV1().EndpointSlices(apiscaleNS).Update(context.Background(), sl, metav1.UpdateOptions{})
				w := time.Since(pd.t0)
				mu.Lock()
				if err != nil {
					werrs = append(werrs, err)
				} else {
					c.slices[i] = got
					waiting = append(waiting, pd)
					writes = append(writes, float64(w.Microseconds())/1000)
				}
				mu.Unlock()
			}
		})
	}
	apiPID, etcdPID := c.srv.PIDs()
	s0, e0, cpu0 := procCPU(apiPID), procCPU(etcdPID), procCPU(pid)
	start := time.Now()
	go func() {
		defer close(done)
		for k := range total {
			due := start.Add(time.Duration(k) * time.Second / time.Duration(o.Rate))
			time.Sleep(time.Until(due))
			jobs <- k
		}
	}()
	// Watch the maps: every ms, each waiting change's service entry; once
	// it changed, its table.
	deadline := start.Add(o.ChangeFor + 30*time.Second)
	seen := 0
	writersDone := false
	for {
		select {
		case <-done:
			if !writersDone {
				writersDone = true
				close(jobs)
			}
		default:
		}
		mu.Lock()
		batch := slices.Clone(waiting)
		nerr := len(werrs)
		mu.Unlock()
		if nerr > 0 {
			mu.Lock()
			err = errors.Join(werrs...)
			mu.Unlock()
			break
		}
		var keep []*pending
		for _, pd := range batch {
			if !pd.changed {
				var v bpf.LbSvcValue
				if err = p.service(c.vips[pd.i], &v); err != nil {
					err = fmt.Errorf("service %d (%v): pb_services after its change was written: %w", pd.i, c.vips[pd.i], err)
					break
				}
				pd.changed = v != pd.before
			}
			if pd.changed {
				var have map[netip.AddrPort]bool
				if have, err = p.addrs(c.vips[pd.i]); err != nil {
					err = fmt.Errorf("service %d (%v): its table after its change: %w", pd.i, c.vips[pd.i], err)
					break
				}
				if have[pd.new] && !have[pd.old] {
					lat = append(lat, float64(time.Since(pd.t0).Microseconds())/1000)
					seen++
					continue
				}
			}
			keep = append(keep, pd)
		}
		if err != nil {
			break
		}
		mu.Lock()
		// Changes queued while this pass ran stay waiting.
		waiting = append(keep, waiting[len(batch):]...)
		left := len(waiting)
		mu.Unlock()
		if writersDone && seen+len(werrs) >= total && left == 0 {
			elapsed = time.Since(start)
			break
		}
		if time.Now().After(deadline) {
			err = fmt.Errorf("%d of %d changes not in the maps %v after the last write", left, total, 30*time.Second)
			break
		}
		time.Sleep(time.Millisecond)
	}
	if !writersDone {
		<-done
		close(jobs)
	}
	wg.Wait()
	if err != nil {
		return
	}
	// CPU over the window the changes were made in (the last change's
	// work included).
	cpu1, s1, e1 := procCPU(pid), procCPU(apiPID), procCPU(etcdPID)
	cpu, serverCPU = cpu1-cpu0, (s1-s0)+(e1-e0)
	*change += total
	return
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// pct is the q-th percentile (nearest rank) of xs.
func pct(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	k := int(q/100*float64(len(s))+0.5) - 1
	return s[max(0, min(len(s)-1, k))]
}

// procByArg finds the process running binary with arg among its
// arguments.
func procByArg(binary, arg string) (int, error) {
	return findAgent(binary, func(_ []byte, args []string) bool { return slices.Contains(args, arg) })
}

// copyFile copies src to dst (created or truncated).
func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o644)
}
