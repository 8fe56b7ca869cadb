// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
	"github.com/penaltybox/penaltybox/pkg/nfct"
	"github.com/penaltybox/penaltybox/pkg/outcomes"
	"github.com/penaltybox/penaltybox/pkg/replay"
)

// Node is an agent over a loaded datapath: the production wiring of
// Config (real maps, the conntrack reaper, the XDP links, the ring buffer).
type Node struct {
	*Agent
	Datapath *datapath.Datapath
	log      *slog.Logger
	maps     *maps.Maps
	inflight *maps.Inflight
	reader   *outcomes.Reader
	// replaySock sends the replays where the kernel refuses the
	// live-frame mode (nil elsewhere).
	replaySock *replay.Socket
}

// NodeOptions configure Open.
type NodeOptions struct {
	Datapath datapath.Options
	Log      *slog.Logger
	// TableSize and MaxInflightDefault: see Config.
	TableSize, MaxInflightDefault uint32
	// NoKernelTrips, SYNGuard, TrackerMemory: see Config.
	NoKernelTrips bool
	SYNGuard      maps.SYNGuard
	// NoKernelSweep: the conntrack sweep copies the table instead of
	// running in the kernel (pb_ct_sweep_run), whose walks the kernel
	// does not preempt.
	NoKernelSweep bool
	TrackerMemory int64
	// Config: the datapath's settings, what it takes as a backend's
	// answer (the reverse-path check, the SYN retransmission's minimum
	// age), the flow hash's seed and the dead-man's bound. A zero HashSeed
	// keeps the seed the pinned datapath has, or draws a random one for a
	// new datapath.
	Config maps.Config
	// TakeoverGrace: see reconcile.Options.TakeoverGrace.
	TakeoverGrace time.Duration
}

// Open loads (or adopts) the datapath's maps and builds the agent over
// them. The caller starts the program's load (Datapath.StartProgramLoad)
// when it suits it; attaching waits for it.
func Open(o NodeOptions) (_ *Node, err error) {
	o.Datapath.Logger = o.Log
	n := &Node{log: o.Log}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	if n.Datapath, err = datapath.LoadMaps(o.Datapath); err != nil {
		return nil, err
	}
	if n.maps, err = maps.New(&n.Datapath.LbMaps, n.Datapath.InnerSpec); err != nil {
		return nil, err
	}
	if err = n.maps.UseStatsReset(n.Datapath.PbStatsResetRun); err != nil {
		return nil, err
	}
	if n.inflight, err = n.maps.OpenInflight(); err != nil {
		return nil, err
	}
	if p := n.Datapath.PbCtExpireRun; p != nil {
		if err := n.maps.UseCTExpire(p); err != nil {
			n.log.Warn("conntrack sweep program not used: the sweep deletes with a system call per entry", "err", err)
		}
	}
	switch p := n.Datapath.PbCtSweepRun; {
	case o.NoKernelSweep:
		n.log.Info("the agent sweeps a copy of the conntrack table (--kernel-sweep=false)")
	case p != nil:
		if err := n.maps.UseCTSweep(p); err != nil {
			n.log.Warn("kernel conntrack sweep not used: the agent sweeps a copy of the table", "err", err)
		}
	}
	// Replays run the program in BPF_PROG_RUN's live-frame mode, which some
	// hardened kernels refuse even to root. There the agent sends them
	// through a raw socket (replay.Socket) if it may, and says so once;
	// without CAP_NET_RAW it replays nothing (no deadlines to keep, no
	// failing call per refused SYN) and says that. A probe that could not
	// run (its program not loaded) leaves replays on: each then says for
	// itself.
	rp := replay.New(n.Datapath.Program, n.maps)
	var replayer Replayer = rp
	switch err := replay.Probe(); {
	case errors.Is(err, replay.ErrLiveFramesRefused):
		sock, serr := replay.OpenSocket()
		if serr != nil {
			replayer = nil
			n.log.Warn("SYN replays off: a refused SYN waits for the client's own retransmission, which goes to another backend; an unanswered one too once its backend is ejected", "err", err, "socket", serr)
			break
		}
		n.replaySock = sock
		rp.SendThrough(sock)
		n.log.Info("SYN replays sent through a raw socket: the kernel refuses the live-frame mode", "err", err)
	case err != nil:
		n.log.Warn("SYN replays not checked at start: they stay on", "err", err)
	}
	reaper := &conntrack.Reaper{Maps: n.maps, Inflight: n.inflight,
		Timeouts: conntrack.DefaultTimeouts(), Clocks: conntrack.KernelClocks()}
	opts := n.Datapath.Opts
	n.Agent, err = New(Config{
		Log: o.Log, Clock: clock.RealClock{},
		Writer: n.maps, Stats: n.maps, Inflight: n.inflight, Sweeper: reaper, Hooks: n.Datapath,
		MaxServices: opts.MaxServices, MaxBackends: opts.MaxBackends,
		TableSize: o.TableSize, MaxInflightDefault: o.MaxInflightDefault, NoKernelTrips: o.NoKernelTrips,
		SYNGuard: o.SYNGuard, TakeoverGrace: o.TakeoverGrace, TrackerMemory: o.TrackerMemory,
		Replayer: replayer, Fresh: n.Datapath.Fresh(),
	})
	if err != nil {
		return nil, err
	}
	c := o.Config
	pinned, _ := n.maps.Config()
	if c.HashSeed == 0 {
		if c.HashSeed, err = keptSeed(pinned); err != nil {
			return nil, err
		}
	}
	// The previous agent's heartbeat stays until this one's loop runs,
	// after the first desired state is in the maps: a datapath handing
	// new flows to kube-proxy goes on doing so until the maps it would
	// take them with are current again.
	c.Heartbeat = pinned.Heartbeat
	if n.reportAbsence(pinned) {
		// kube-proxy had their new flows meanwhile: its flows are alive,
		// or linger in the kernel's conntrack.
		if err := n.Agent.TakeOverAll(); err != nil {
			n.log.Warn("marking the services taken over after the agent's absence", "err", err)
		}
	}
	if err := n.Agent.SetDatapathConfig(c); err != nil {
		return nil, err
	}
	return n, nil
}

// Uninstall removes the datapath because the install is being deleted:
// new flows go to kube-proxy at once, the flows here are given up to wait
// to end (a download finishing where it began), then the program is
// detached and every pin removed, leaving the node as it was. A flow
// still passing packets when wait runs out is cut, as kube-proxy would
// cut it after a change of endpoints. n is closed.
func (n *Node) Uninstall(wait time.Duration) error {
	if err := n.Agent.Drain(); err != nil {
		n.log.Error("draining before the uninstall", "err", err)
	}
	start := time.Now()
	live := -1
	for {
		coarse := uint64(conntrack.KernelClocks().Coarse())
		if entries, err := n.maps.Conntrack(0); err == nil {
			live = liveFlows(entries, coarse)
		}
		if live == 0 || time.Since(start) >= wait {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	n.log.Info("uninstalling: detaching the datapath and removing its pins",
		"waited", time.Since(start).Round(time.Millisecond).String(), "flows_left", live)
	var vips []netip.AddrPort
	if svcs, err := n.maps.Services(); err == nil {
		for k := range svcs {
			vips = append(vips, netip.AddrPortFrom(maps.AddrFromFamily(k.Family, k.Vip.Bytes), maps.Port(k.Port)))
		}
	}
	root := n.Datapath.Opts.Root
	n.Close()
	err := datapath.Teardown(root, n.log)
	// Detached, the datapath no longer clears what its flows left in the
	// kernel's conntrack: those entries would capture kube-proxy's next
	// connections from the same client ports (see pkg/nfct).
	forgot, ferr := nfct.ForgetReplies(vips)
	if ferr != nil {
		n.log.Warn("clearing the kernel's conntrack of the datapath's replies", "err", ferr)
	}
	n.log.Info("uninstalled", "conntrack_entries_cleared", forgot)
	return err
}

// liveFlows counts the flows of entries still open and passing packets
// (their reverse entry refreshed within the last 3 s: it is refreshed
// once a second while packets flow), at coarse (CLOCK_MONOTONIC_COARSE).
func liveFlows(entries []maps.CTEntry, coarse uint64) int {
	n := 0
	for _, e := range entries {
		if e.Key.Dir == 1 && e.Value.Flags&maps.CTClosed == 0 && coarse-e.Value.LastSeenNs < uint64(3*time.Second) {
			n++
		}
	}
	return n
}

// reportAbsence says, once, whether the datapath handed new flows to
// kube-proxy while no agent ran: its heartbeat (pinned, the previous
// agent's) is older than its dead-man's bound.
func (n *Node) reportAbsence(pinned maps.Config) bool {
	if pinned.Heartbeat == 0 || pinned.DeadMan == 0 {
		return false
	}
	away := time.Duration(outcomes.MonoNow() - int64(pinned.Heartbeat))
	if away <= pinned.DeadMan {
		return false
	}
	var handed uint64
	if gs, err := n.maps.GlobalStats(); err == nil {
		handed = gs.HandedOver
	}
	n.log.Warn("no agent for longer than the dead-man's bound: the datapath handed new flows to kube-proxy meanwhile; taking them back once the maps are current",
		"away", away.Round(time.Second).String(), "dead_man", pinned.DeadMan.String(), "handed_over_total", handed)
	return true
}

// keptSeed is the flow hash's seed the pinned datapath holds (a restart
// keeps every pick), or a random one for a new datapath.
func keptSeed(pinned maps.Config) (uint32, error) {
	if pinned.HashSeed != 0 {
		return pinned.HashSeed, nil
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, fmt.Errorf("hash seed: %w", err)
	}
	return binary.NativeEndian.Uint32(b[:]) | 1, nil
}

// Begin is called once the first desired state is programmed and XDP is
// attached: the agent reports ready, and the ring buffer's events start
// flowing to it.
func (n *Node) Begin() error {
	reader, err := outcomes.NewReader(n.Datapath.PbEvents)
	if err != nil {
		return err
	}
	// HandleEvents keeps nothing of a batch.
	reader.Reuse = true
	n.reader = reader
	n.Agent.Begin(reader)
	go func() {
		if err := reader.Run(n.HandleEvents); err != nil {
			n.EventsStopped(err)
		}
	}()
	return nil
}

// Close releases the process's handles; the pins stay, and the datapath
// keeps forwarding with the last programmed state.
func (n *Node) Close() {
	if n.reader != nil {
		n.reader.Close()
		n.reader = nil
	}
	if n.replaySock != nil {
		n.replaySock.Close()
		n.replaySock = nil
	}
	if n.inflight != nil {
		n.inflight.Close()
		n.inflight = nil
	}
	if n.maps != nil {
		n.maps.Close()
		n.maps = nil
	}
	if n.Datapath != nil {
		n.Datapath.Close()
		n.Datapath = nil
	}
}
