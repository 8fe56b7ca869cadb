package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/penaltybox/penaltybox/internal/bpftest"
	"github.com/penaltybox/penaltybox/pkg/csum"
)

// progRunAttr is the BPF_PROG_TEST_RUN member of union bpf_attr. cilium/ebpf
// returns either the output packet (Program.Run) or the kernel's duration
// (Program.Benchmark), never both from one call; the benchmark needs both:
// every timed run is checked by what it did to the packet.
type progRunAttr struct {
	progFd      uint32
	retval      uint32
	dataSizeIn  uint32
	dataSizeOut uint32
	dataIn      uint64
	dataOut     uint64
	repeat      uint32
	duration    uint32
	ctxSizeIn   uint32
	ctxSizeOut  uint32
	ctxIn       uint64
	ctxOut      uint64
	flags       uint32
	cpu         uint32
	batchSize   uint32
	_           uint32
}

const bpfProgTestRun = 10

// testRun runs prog repeat times on in (the kernel reuses one buffer, so
// from the second run on the program sees its own output), copies the
// final packet into out and returns the verdict, the final packet length
// and the kernel's duration per run in nanoseconds (measured by the kernel
// around the program, bpf_test_timer).
func testRun(prog *ebpf.Program, in, out []byte, repeat uint32) (ret uint32, n int, ns uint32, err error) {
	var pin runtime.Pinner
	pin.Pin(&in[0])
	pin.Pin(&out[0])
	defer pin.Unpin()
	attr := progRunAttr{
		progFd:      uint32(prog.FD()),
		dataSizeIn:  uint32(len(in)),
		dataSizeOut: uint32(len(out)),
		dataIn:      uint64(uintptr(unsafe.Pointer(&in[0]))),
		dataOut:     uint64(uintptr(unsafe.Pointer(&out[0]))),
		repeat:      repeat,
	}
	for {
		_, _, errno := unix.Syscall(unix.SYS_BPF, bpfProgTestRun, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
		if errno == unix.EINTR {
			// Interrupted (Go's preemption signal): the call is made
			// again. Its timing covers that call only, but the runs
			// before the interruption did count in the datapath's
			// counters: see counted.
			testRunRestarts.Add(1)
			continue
		}
		if errno != 0 {
			return 0, 0, 0, fmt.Errorf("BPF_PROG_TEST_RUN: %w", errno)
		}
		return attr.retval, int(attr.dataSizeOut), attr.duration, nil
	}
}

// mountBPFFS mounts a private bpffs and returns a pin root inside it and
// a function that unmounts it.
func mountBPFFS() (string, func(), error) {
	dir, err := os.MkdirTemp("", "pb-bench-bpffs-")
	if err != nil {
		return "", nil, err
	}
	mnt := filepath.Join(dir, "bpffs")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return "", nil, err
	}
	if err := unix.Mount("bpf", mnt, "bpf", 0, "mode=0700"); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("mount bpffs: %w", err)
	}
	return filepath.Join(mnt, "penaltybox"), func() {
		unix.Unmount(mnt, unix.MNT_DETACH)
		os.RemoveAll(dir)
	}, nil
}

// Offsets in an Ethernet/IPv4(IHL 5)/TCP frame.
const (
	offIPCsum  = 14 + 10
	offSrcIP   = 14 + 12
	offDstIP   = 14 + 16
	offSport   = 14 + 20
	offDport   = 14 + 22
	offTCPCsum = 14 + 20 + 16
)

// frame is a crafted TCP packet that can be re-addressed in place, with
// checksums recomputed from scratch.
type frame []byte

func tcpFrame(src, dst netip.AddrPort, f bpftest.TCPFlags) frame {
	return frame(bpftest.TCP(src, dst, f, nil))
}

// setSrc re-addresses the frame's source and fixes both checksums.
func (p frame) setSrc(a netip.AddrPort) {
	b := a.Addr().As4()
	copy(p[offSrcIP:], b[:])
	binary.BigEndian.PutUint16(p[offSport:], a.Port())
	p.fixChecksums()
}

func (p frame) fixChecksums() {
	ip := p[14:34]
	binary.BigEndian.PutUint16(ip[10:], 0)
	binary.BigEndian.PutUint16(ip[10:], ^csum.Fold(csum.Sum(ip, 0)))
	csum.SetTCP4(p)
}

func dstOf(p []byte) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(p[offDstIP:offDstIP+4])), binary.BigEndian.Uint16(p[offDport:]))
}

func srcOf(p []byte) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(p[offSrcIP:offSrcIP+4])), binary.BigEndian.Uint16(p[offSport:]))
}

// checkFrame verifies with an independent parser (gopacket) that the
// frame's checksums are valid and returns its addresses.
func checkFrame(p []byte) (src, dst netip.AddrPort, err error) {
	parsed, err := bpftest.Parse(p)
	if err != nil {
		return src, dst, err
	}
	return parsed.Src, parsed.Dst, nil
}

var errPath = errors.New("path check failed")

// be32 is an IPv4 address as a __be32 field: network byte order read as
// a host integer.
func be32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.NativeEndian.Uint32(b[:])
}

// testRunRestarts counts BPF_PROG_TEST_RUN calls made again after EINTR.
var testRunRestarts atomic.Uint64

// counted runs a measurement whose check compares the datapath's counters
// with the number of runs, again (at most 3 times in all) when its check
// failed while a test run in it was interrupted and made again: the
// interrupted call's runs counted too, so its counts are not the runs'.
// A check that fails without an interruption fails.
func counted(measure func() (float64, error)) (float64, error) {
	var v float64
	var err error
	for range 3 {
		r0 := testRunRestarts.Load()
		v, err = measure()
		if err == nil || !errors.Is(err, errPath) || testRunRestarts.Load() == r0 {
			return v, err
		}
	}
	return v, err
}
