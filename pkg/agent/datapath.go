package agent

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"log/slog"

	"k8s.io/utils/clock"

	"github.com/penaltybox/penaltybox/pkg/conntrack"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
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
	TrackerMemory int64
	// Evidence: the datapath's settings for what it takes as a backend's
	// answer (the reverse-path check, the SYN retransmission's minimum
	// age) and the flow hash's seed. A zero HashSeed keeps the seed the
	// pinned datapath has, or draws a random one for a new datapath.
	Evidence maps.Config
}

// Open loads (or adopts) the datapath and builds the agent over it.
func Open(o NodeOptions) (_ *Node, err error) {
	o.Datapath.Logger = o.Log
	n := &Node{log: o.Log}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	if n.Datapath, err = datapath.Load(o.Datapath); err != nil {
		return nil, err
	}
	if n.maps, err = maps.New(&n.Datapath.LbMaps, n.Datapath.InnerSpec); err != nil {
		return nil, err
	}
	if n.inflight, err = n.maps.OpenInflight(); err != nil {
		return nil, err
	}
	reaper := &conntrack.Reaper{Maps: n.maps, Inflight: n.inflight,
		Timeouts: conntrack.DefaultTimeouts(), Clocks: conntrack.KernelClocks()}
	opts := n.Datapath.Opts
	n.Agent, err = New(Config{
		Log: o.Log, Clock: clock.RealClock{},
		Writer: n.maps, Stats: n.maps, Inflight: n.inflight, Sweeper: reaper, Hooks: n.Datapath,
		MaxServices: opts.MaxServices, MaxBackends: opts.MaxBackends,
		TableSize: o.TableSize, MaxInflightDefault: o.MaxInflightDefault, NoKernelTrips: o.NoKernelTrips,
		SYNGuard: o.SYNGuard, TrackerMemory: o.TrackerMemory,
		Replayer: replay.New(n.Datapath.PbXdp, n.maps),
	})
	if err != nil {
		return nil, err
	}
	c := o.Evidence
	if c.HashSeed == 0 {
		if c.HashSeed, err = n.keptSeed(); err != nil {
			return nil, err
		}
	}
	if err := n.Agent.SetDatapathConfig(c); err != nil {
		return nil, err
	}
	return n, nil
}

// keptSeed is the flow hash's seed the pinned datapath holds (a restart
// keeps every pick), or a random one for a new datapath.
func (n *Node) keptSeed() (uint32, error) {
	if c, err := n.maps.Config(); err == nil && c.HashSeed != 0 {
		return c.HashSeed, nil
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
	}
	if n.inflight != nil {
		n.inflight.Close()
	}
	if n.maps != nil {
		n.maps.Close()
	}
	if n.Datapath != nil {
		n.Datapath.Close()
	}
}
