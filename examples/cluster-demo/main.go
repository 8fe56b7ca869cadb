// Command cluster-demo tells the seed story on a one-node Kubernetes
// cluster of real components (scripts/cluster.sh): deploy/ applied with
// `kubectl apply -k`, two good backend pods and one that passes its
// readiness probe but refuses, later resets, every connection, one Service
// with Linkerd's failure-accrual annotations (workloads.yaml), and a client
// pod opening 50 new connections a second to the ClusterIP. It prints one
// table row per second of the client's outcomes and which pod served them,
// the agent's Events as they come, and what `kubectl get pods` and
// `agent inspect` say meanwhile; then it tears everything down.
//
//	make cluster-demo     (root; builds the images and the cluster's binaries)
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/penaltybox/penaltybox/internal/clientlog"
	"github.com/penaltybox/penaltybox/internal/clusterrig"
)

func main() {
	phase := flag.Duration("phase", 25*time.Second, "how long each part of the story runs")
	verbose := flag.Bool("v", false, "show every line of the cluster scripts' progress")
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "cluster-demo: needs root (a kubelet, containerd, network namespaces, BPF)")
		os.Exit(1)
	}
	root, err := filepath.Abs(".")
	if err == nil {
		_, err = os.Stat(filepath.Join(root, clusterrig.Workloads))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cluster-demo: run it from the repository's root (make cluster-demo):", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, root, *phase, *verbose); err != nil {
		fmt.Fprintln(os.Stderr, "cluster-demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, root string, phase time.Duration, verbose bool) error {
	logf := func(format string, args ...any) {
		line := fmt.Sprintf(format, args...)
		if verbose || strings.HasPrefix(line, "cluster: ") {
			fmt.Println("  " + line)
		}
	}
	fmt.Println("Starting a one-node cluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,")
	fmt.Println("kube-proxy, a kubelet, containerd and the CNI bridge plugin, in network namespaces of their own.")
	rig, err := clusterrig.Up(ctx, root, "pb-cluster-demo", logf)
	if err != nil {
		return err
	}
	defer func() {
		fmt.Println("\nTearing the cluster down.")
		rig.Down()
	}()
	k := func(args ...string) (string, error) { return rig.Kubectl(context.WithoutCancel(ctx), args...) }

	fmt.Println("\n$ kubectl apply -k deploy/   (the image set to the one built from this checkout)")
	if err := rig.InstallAgent(ctx); err != nil {
		return err
	}
	fmt.Println("$ kubectl apply -f", clusterrig.Workloads)
	if err := rig.StartWorkloads(ctx); err != nil {
		return err
	}
	var list struct {
		Items []struct {
			Metadata struct {
				Name   string            `json:"name"`
				Labels map[string]string `json:"labels"`
			} `json:"metadata"`
			Status struct {
				PodIP string `json:"podIP"`
			} `json:"status"`
		} `json:"items"`
	}
	if err := rig.KubectlJSON(ctx, &list, "get", "pods", "-l", "app=backend"); err != nil {
		return err
	}
	var pods []string
	var badIP, badName string
	for _, p := range list.Items {
		pods = append(pods, p.Metadata.Name)
		if p.Metadata.Labels["role"] == "bad" {
			badIP, badName = p.Status.PodIP, p.Metadata.Name
		}
	}
	sort.Strings(pods)
	s := &story{rig: rig, pods: pods, bad: badName, seen: map[string]bool{}}

	// Each failing phase runs for phase; each healed one until the pod
	// serves again (its next probe: up to the max-penalty of 30 s away),
	// and 5 s more.
	steps := []struct {
		title  string
		mode   string
		healed bool
	}{
		{fmt.Sprintf("%s refuses every connection on the service port (it stays Ready: its probe is on another port)", badName), "", false},
		{"healed: it serves again once a probe connection succeeds", "serve", true},
		{fmt.Sprintf("%s resets every connection right after the handshake", badName), "reset", false},
		{"healed again", "serve", true},
	}
	for i, step := range steps {
		if step.mode != "" {
			if err := rig.SetMode(badIP, step.mode); err != nil {
				return err
			}
		}
		fmt.Printf("\n%d. %s\n\n", i+1, step.title)
		d, until := phase, func(clientlog.Second) bool { return false }
		if step.healed {
			d = time.Minute
			until = func(sec clientlog.Second) bool { return sec.Backends[badName] > 0 }
		}
		if err := s.watch(ctx, d, until); err != nil {
			return err
		}
		if i == 0 || i == 2 {
			out, _ := k("get", "pods", "-o", "wide")
			fmt.Printf("\n$ kubectl get pods\n%s", indent(out))
			out, _ = k("exec", "-n", clusterrig.AgentNamespace, clusterrig.AgentDaemonSet, "--", "agent", "inspect")
			fmt.Printf("\n$ kubectl exec -n %s %s -- agent inspect\n%s", clusterrig.AgentNamespace, clusterrig.AgentDaemonSet, indent(out))
		}
	}
	return nil
}

// story prints the client's seconds and the agent's Events as they come.
type story struct {
	rig    *clusterrig.Rig
	pods   []string
	bad    string
	shown  time.Time
	seen   map[string]bool // Events already printed, by message and count
	header bool
}

// watch prints for d, or until a second satisfies until and 5 s more.
func (s *story) watch(ctx context.Context, d time.Duration, until func(clientlog.Second) bool) error {
	end := time.Now().Add(d)
	var phase clientlog.Second
	for time.Now().Before(end) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
		secs, err := s.rig.ClientSeconds(ctx, "default")
		if err != nil {
			return err
		}
		if !s.header {
			s.header = true
			fmt.Printf("   %-8s %5s %8s %6s %8s %6s", "time", "ok", "refused", "reset", "timeout", "other")
			for i, p := range s.pods {
				fmt.Printf(" %11s", s.short(i, p))
			}
			fmt.Println()
		}
		for _, sec := range secs {
			if !sec.T.After(s.shown) {
				continue
			}
			s.shown = sec.T
			if until(sec) && time.Until(end) > 5*time.Second {
				end = time.Now().Add(5 * time.Second)
			}
			phase.Add(sec)
			fmt.Printf("   %-8s %5d %8d %6d %8d %6d", sec.T.Local().Format("15:04:05"), sec.OK, sec.Refused, sec.Reset, sec.Timeout, sec.Other+sec.Skipped)
			for _, p := range s.pods {
				fmt.Printf(" %11d", sec.Backends[p])
			}
			fmt.Println()
		}
		s.events(ctx)
	}
	if all := phase.OK + phase.Failed(); all > 0 {
		fmt.Printf("\n   %d of %d connections succeeded (%.2f%%)\n", phase.OK, all, 100*float64(phase.OK)/float64(all))
	}
	return nil
}

// short names a backend column: the bad pod, or good pod 1, 2, ...
func (s *story) short(i int, pod string) string {
	if pod == s.bad {
		return "bad pod"
	}
	n := i + 1
	if i > slices.Index(s.pods, s.bad) && slices.Contains(s.pods, s.bad) {
		n--
	}
	return fmt.Sprintf("good pod %d", n)
}

// events prints the agent's Events not printed yet.
func (s *story) events(ctx context.Context) {
	var list struct {
		Items []struct {
			Reason  string `json:"reason"`
			Message string `json:"message"`
			Count   int    `json:"count"`
		} `json:"items"`
	}
	if s.rig.KubectlJSON(ctx, &list, "get", "events", "--field-selector", "involvedObject.kind=Service") != nil {
		return
	}
	for _, e := range list.Items {
		key := fmt.Sprintf("%s/%d", e.Message, e.Count)
		if s.seen[key] {
			continue
		}
		s.seen[key] = true
		fmt.Printf("   Event %s: %s\n", e.Reason, e.Message)
	}
}

func indent(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return "   " + strings.Join(lines, "\n   ") + "\n"
}
