// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"runtime"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/datapath"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// A pbVariant is another build of pb_xdp (bench/variants/build.sh: the
// datapath with pieces of its path taken out, or another revision with the
// same map layouts), measured with the datapath's own maps and state in
// the same rounds as the unmodified program: section 1d, a diagnostic of
// where the time goes (--pb-variant NAME=OBJ, repeatable).
type pbVariant struct {
	Name string
	Path string
	prog *ebpf.Program
}

// variantFlag collects --pb-variant NAME=OBJ.
type variantFlag []pbVariant

func (v *variantFlag) String() string {
	var s []string
	for _, x := range *v {
		s = append(s, x.Name+"="+x.Path)
	}
	return strings.Join(s, ",")
}

func (v *variantFlag) Set(s string) error {
	name, path, ok := strings.Cut(s, "=")
	if !ok || name == "" || path == "" {
		return fmt.Errorf("want NAME=OBJECT, got %q", s)
	}
	*v = append(*v, pbVariant{Name: name, Path: path})
	return nil
}

// loadVariant loads the pb_xdp of the object at path with every map the
// object shares with the datapath (by name) replaced by the datapath's.
func (r *packetRig) loadVariant(path string) (*ebpf.Program, error) {
	spec, err := ebpf.LoadCollectionSpec(path)
	if err != nil {
		return nil, err
	}
	repl := map[string]*ebpf.Map{}
	v := reflect.ValueOf(r.dp.LbMaps)
	t := v.Type()
	for i := range t.NumField() {
		name := t.Field(i).Tag.Get("ebpf")
		m, _ := v.Field(i).Interface().(*ebpf.Map)
		ms, ok := spec.Maps[name]
		if !ok || m == nil {
			continue
		}
		ms.MaxEntries = m.MaxEntries()
		repl[name] = m
	}
	for _, ms := range spec.Maps {
		ms.Pinning = ebpf.PinNone
	}
	// The conntrack kfuncs where the datapath's loader turns them on.
	if v, ok := spec.Variables[bpf.LbVarPbNfKfuncs]; ok && datapath.HaveNFKfuncs() {
		if err := v.Set(uint32(1)); err != nil {
			return nil, err
		}
	}
	for name := range spec.Programs {
		if name != bpf.LbProgPbXdp {
			delete(spec.Programs, name)
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("%s: verifier: %+v", path, ve)
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	prog := coll.DetachProgram(bpf.LbProgPbXdp)
	coll.Close() // the maps it created itself (none shared) go with it; prog holds its own
	if prog == nil {
		return nil, fmt.Errorf("%s: no pb_xdp", path)
	}
	return prog, nil
}

// The paths a variant is measured on, each beside the unmodified program.
const (
	vEst  = "established flow"
	vPT   = "pass-through, non-VIP port"
	vNew  = "new flow SYN"
	vFull = "new flow into a full conntrack"
)

// variantRound measures the unmodified pb_xdp and every variant on each
// path, path by path (the variants of one path one right after another).
// Only the packets are checked (a variant may have no counters or events);
// state a variant leaves is removed as the main rows remove theirs.
func (r *packetRig) variantRound(res *Results, vs []pbVariant, rep uint32, n int) error {
	progs := append([]pbVariant{{Name: "pb_xdp (as built)", prog: r.dp.PbXdp}}, vs...)
	pass := tcpFrame(netip.MustParseAddrPort("198.18.0.2:40000"), pkNode, bpftest.ACK)
	for _, path := range []string{vEst, vPT, vNew, vFull} {
		for i, v := range progs {
			var ns float64
			var err error
			switch path {
			case vEst:
				ns, err = r.repeatRun(v.prog, tcpFrame(pkClient, pkA, bpftest.ACK), rep, ended(pkClient, pkB))
			case vPT:
				ns, err = r.repeatRun(v.prog, pass, rep, unchanged(pass))
			case vNew, vFull:
				ns, err = r.variantNewFlows(v.prog, n, path == vFull)
			}
			if err != nil {
				return fmt.Errorf("variant %s, %s: %w", v.Name, path, err)
			}
			base := ""
			if i > 0 {
				base = progs[0].Name + ": " + path
			}
			f := res.figure("variant", v.Name+": "+path, "ns/pkt")
			f.Baseline, f.Digits = base, 1
			f.Samples = append(f.Samples, ns)
		}
	}
	return nil
}

// variantNewFlows is newFlows(nfPlain) (or nfFullCT) for any build of
// pb_xdp: n SYNs of distinct flows to service 1, each output's backend
// checked, the median kernel time. The events it leaves are read before
// it returns, and its conntrack entries removed (conntrack emptied after a
// full-table batch).
func (r *packetRig) variantNewFlows(prog *ebpf.Program, n int, full bool) (float64, error) {
	if full {
		if err := r.fillCT(); err != nil {
			return 0, err
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	backends := map[netip.AddrPort]bool{}
	for _, a := range floorBackends {
		backends[netip.MustParseAddrPort(a)] = true
	}
	read0 := r.read.Load()
	pkt := tcpFrame(pkClient, pkVIPNew, bpftest.SYN)
	durs := make([]float64, 0, n)
	keys := make([]bpf.LbCtKey, 0, 2*n)
	for range n {
		c := r.nextClient()
		pkt.setSrc(c)
		ret, sz, ns, err := testRun(prog, pkt, r.out, 1)
		if err != nil {
			return 0, err
		}
		if err := wantPass(ret); err != nil {
			return 0, err
		}
		dst := dstOf(r.out[:sz])
		if !backends[dst] {
			return 0, fmt.Errorf("new flow from %v went to %v", c, dst)
		}
		durs = append(durs, float64(ns))
		var f, rv bpf.LbCtKey
		f.Src.Bytes, f.Dst.Bytes = maps.Addr16(c.Addr()), maps.Addr16(pkVIPNew.Addr())
		f.Sport, f.Dport = maps.Port(c.Port()), maps.Port(pkVIPNew.Port())
		f.Proto, f.Dir, f.Family = 6, maps.DirFwd, maps.FamilyIPv4
		rv.Src.Bytes, rv.Dst.Bytes = maps.Addr16(dst.Addr()), f.Src.Bytes
		rv.Sport, rv.Dport = maps.Port(dst.Port()), f.Sport
		rv.Proto, rv.Dir, rv.Family = 6, maps.DirRev, maps.FamilyIPv4
		keys = append(keys, f, rv)
	}
	// Its events read (up to n; a variant may send none): quiet for 50 ms.
	last, quiet := r.read.Load(), time.Now()
	for r.read.Load()-read0 < uint64(n) && time.Since(quiet) < 50*time.Millisecond {
		time.Sleep(time.Millisecond)
		if x := r.read.Load(); x != last {
			last, quiet = x, time.Now()
		}
	}
	if full {
		return median(durs), r.resetCT()
	}
	for _, k := range keys {
		if err := r.dp.PbCtV2.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, err
		}
	}
	return median(durs), nil
}

// variantFigures orders section 1d (the unmodified rows first on each
// path) and says what it is.
func variantFigures(res *Results, vs []pbVariant, r *packetRig) {
	var other, vr []*Figure
	for _, f := range res.Figures {
		if f.Part != "variant" {
			other = append(other, f)
		}
	}
	for _, path := range []string{vEst, vPT, vNew, vFull} {
		for _, v := range append([]pbVariant{{Name: "pb_xdp (as built)"}}, vs...) {
			if f := res.find("variant", v.Name+": "+path); f != nil {
				vr = append(vr, f)
			}
		}
	}
	res.Figures = append(other, vr...)
	res.extra("variant", "| variant | object | xlated insns | jited bytes | insns processed by the verifier |\n|---|---|--:|--:|--:|")
	for _, v := range vs {
		res.extra("variant", "%s", strings.Replace(progStats(v.Name, v.prog), "| "+v.Name+" |", "| "+v.Name+" | "+v.Path+" |", 1))
	}
	res.note("variant", "Diagnostic rows: builds of pb_xdp given with --pb-variant (bench/variants/build.sh takes named pieces out of bpf/lb.c), each loaded with the datapath's own maps and measured in the same rounds as the unmodified program, path by path, one right after another. The established and pass-through rows are repeat runs as in section 1 (%s); the new-flow rows %s as section 1's, into the empty and into the full conntrack. Only the packets are checked here (a variant may count or report nothing); what a piece costs is its row's difference from the unmodified row of the same round.", "the same frames", "the same SYNs")
}

// firstLine is s up to its first newline (a verifier log is long).
func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}
