// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// netnsDir is where iproute2 keeps named network namespaces (bind mounts).
const netnsDir = "/run/netns"

// NS is one network namespace created by this package. Its methods are safe
// for concurrent use. Every socket made through an NS (Listen, ListenPacket,
// Dialer, HTTPGet, Load) lives in the namespace for its whole life, and can
// be used from any goroutine afterwards.
type NS struct {
	// Name is the namespace's name as `ip netns list` shows it
	// (a bind mount at /run/netns/<Name>).
	Name string
	// Role is "node", "client" or the backend name ("b1", "b2", ...).
	Role string

	mu     sync.RWMutex // guards fd against Close while entering
	fd     int          // O_RDONLY on /run/netns/<Name>; -1 after close
	closed bool

	poolMu sync.Mutex
	pools  map[sockKey]*sockPool // nil after close
}

// Path is the namespace's bind-mount path, usable with setns(2),
// `nsenter --net=PATH`, or netlink.NsFd after opening it.
func (n *NS) Path() string { return filepath.Join(netnsDir, n.Name) }

func (n *NS) String() string { return n.Name }

// openNS opens an existing named namespace.
func openNS(name, role string) (*NS, error) {
	fd, err := unix.Open(filepath.Join(netnsDir, name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("testnet: open netns %s: %w", name, err)
	}
	return &NS{Name: name, Role: role, fd: fd, pools: map[sockKey]*sockPool{}}, nil
}

// Open opens a named network namespace that something else made and owns
// (the cluster rig's node, say), for Do, Listen, HTTPClient and the rest.
// Close releases it; the namespace stays.
func Open(name string) (*NS, error) { return openNS(name, name) }

// Close releases a namespace from Open. It does not delete it.
func (n *NS) Close() { n.close() }

// close releases the namespace file descriptor and the socket pools. It does
// not delete the namespace (see deleteNetns).
func (n *NS) close() {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return
	}
	n.closed = true
	n.mu.Unlock()
	n.poolMu.Lock()
	pools := n.pools
	n.pools = nil
	n.poolMu.Unlock()
	for _, p := range pools {
		p.close() // the filler threads leave the namespace by exiting
	}
	n.mu.Lock()
	fd := n.fd
	n.fd = -1
	n.mu.Unlock()
	if fd >= 0 {
		unix.Close(fd)
	}
}

var errClosed = errors.New("testnet: namespace closed")

// enter switches the calling (locked!) OS thread into the namespace.
func (n *NS) enter() error {
	n.mu.RLock()
	defer n.mu.RUnlock()
	if n.closed {
		return errClosed
	}
	if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("testnet: setns into %s: %w", n.Name, err)
	}
	return nil
}

// Do runs fn on a goroutine locked to an OS thread that has joined the
// namespace, and waits for it. Sockets (and netlink handles) created inside
// fn belong to the namespace for their whole life.
//
// Only the calling thread is in the namespace: goroutines started by fn run
// on other threads, in the host namespace. fn must not call
// runtime.UnlockOSThread, setns(2) or unshare(2). After fn returns, the
// thread is switched back to the host namespace and handed back to the
// scheduler only if that switch succeeded; otherwise the thread exits with
// the goroutine, so a thread in the wrong namespace is never reused.
// A panic in fn is returned as an error.
func (n *NS) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// If anything below fails we return without UnlockOSThread: the
		// goroutine exits while locked and the runtime kills its thread.
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- fmt.Errorf("testnet: open own netns: %w", err)
			return
		}
		defer unix.Close(orig)
		if err := n.enter(); err != nil {
			errc <- err
			return
		}
		var fnErr error
		func() {
			defer func() {
				if r := recover(); r != nil {
					fnErr = fmt.Errorf("testnet: panic in %s.Do: %v\n%s", n.Name, r, debug.Stack())
				}
			}()
			fnErr = fn()
		}()
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
		errc <- fnErr
	}()
	return <-errc
}

// Listen creates a listener inside the namespace (net.Listen semantics;
// addresses must be literal IPs or empty, e.g. ":80").
func (n *NS) Listen(network, addr string) (net.Listener, error) {
	var l net.Listener
	err := n.Do(func() (err error) {
		l, err = net.Listen(network, addr)
		return err
	})
	return l, err
}

// ListenPacket creates a packet socket (e.g. "udp", ":53") inside the
// namespace.
func (n *NS) ListenPacket(network, addr string) (net.PacketConn, error) {
	var c net.PacketConn
	err := n.Do(func() (err error) {
		c, err = net.ListenPacket(network, addr)
		return err
	})
	return c, err
}

// Command returns a command that runs name inside the namespace via
// `ip netns exec`.
//
// `ip netns exec` also creates a new mount namespace for the program and
// remounts /sys in it (so /sys/class/net shows the namespace's interfaces).
// Consequently mounts made by the program, such as a bpffs at /sys/fs/bpf
// for pinning maps or links, vanish when it exits, and the host's
// /sys/fs/bpf is not visible to it. Use Start for programs that must pin
// BPF objects where the host (and bpftool) can see them.
func (n *NS) Command(name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// Start starts cmd with only its network namespace switched: it is forked
// from a thread that has joined the namespace, so it shares the caller's
// mount namespace (the host's /sys/fs/bpf, where pins persist after it
// exits) — but /sys/class/net still shows the host's interfaces to it, so
// it must find interfaces through netlink (as the agent does). The caller
// owns the process and must Wait for it.
func (n *NS) Start(cmd *exec.Cmd) error {
	return n.Do(cmd.Start)
}

// Run runs args[0] with args[1:] inside the namespace (via Command) and
// returns its combined output. A failure's error includes the output.
func (n *NS) Run(args ...string) (string, error) {
	if len(args) == 0 {
		return "", errors.New("testnet: Run: no command")
	}
	return runCmd(n.Command(args[0], args[1:]...), nil)
}

func runCmd(cmd *exec.Cmd, stdin []byte) (string, error) {
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// Sysctl writes a sysctl inside the namespace, e.g.
// Sysctl("net/ipv4/ip_forward", "1") (dots are accepted too).
func (n *NS) Sysctl(key, value string) error {
	return n.Do(func() error { return writeSysctl(key, value) })
}

// ReadSysctl reads a sysctl inside the namespace.
func (n *NS) ReadSysctl(key string) (string, error) {
	var v string
	err := n.Do(func() error {
		b, err := os.ReadFile(sysctlPath(key))
		v = strings.TrimSpace(string(b))
		return err
	})
	return v, err
}

func sysctlPath(key string) string {
	if !strings.Contains(key, "/") {
		key = strings.ReplaceAll(key, ".", "/")
	}
	return filepath.Join("/proc/sys", key)
}

// writeSysctl must run on a thread inside the target namespace: /proc/sys/net
// resolves against the calling thread's network namespace.
// writeSysctls writes each key/value pair in order, stopping at the first
// error.
func writeSysctls(kvs [][2]string) error {
	for _, kv := range kvs {
		if err := writeSysctl(kv[0], kv[1]); err != nil {
			return err
		}
	}
	return nil
}

func writeSysctl(key, value string) error {
	if err := os.WriteFile(sysctlPath(key), []byte(value), 0); err != nil {
		return fmt.Errorf("testnet: sysctl %s=%s: %w", key, value, err)
	}
	return nil
}

// createNetns creates a named namespace the way iproute2 does (which also
// makes /run/netns a shared mount, so the name is visible from mount
// namespaces created later, e.g. by `ip netns exec`).
func createNetns(name string) error {
	_, err := runCmd(exec.Command("ip", "netns", "add", name), nil)
	return err
}

// deleteNetns removes a named namespace as `ip netns delete` does: detach the
// bind mount and remove the file. The kernel destroys the namespace (and
// every veth end in it, which takes the peer end with it) once nothing else
// references it. Missing namespaces are not an error.
func deleteNetns(name string) error {
	p := filepath.Join(netnsDir, name)
	if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
		return fmt.Errorf("testnet: umount %s: %w", p, err)
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("testnet: remove %s: %w", p, err)
	}
	return nil
}

// TCPCounters reads the namespace's TCP counters (/proc/net/snmp's Tcp
// and /proc/net/netstat's TcpExt lines, e.g. "TcpExt.TCPSynRetrans",
// "TcpExt.ListenDrops"). They are the namespace's own: what its sockets
// did, whatever the node's program did to their packets.
func (n *NS) TCPCounters() (map[string]uint64, error) {
	out := map[string]uint64{}
	err := n.Do(func() error {
		// thread-self: the namespace this thread entered (/proc/self
		// would follow the process's first thread).
		for _, f := range []string{"snmp", "netstat"} {
			b, err := os.ReadFile("/proc/thread-self/net/" + f)
			if err != nil {
				return fmt.Errorf("testnet: %s's counters: %w", n.Name, err)
			}
			if err := parseProcNetCounters(string(b), out); err != nil {
				return fmt.Errorf("testnet: /proc/net/%s: %w", f, err)
			}
		}
		return nil
	})
	return out, err
}

// parseProcNetCounters adds the Tcp and TcpExt counters of a /proc/net/snmp
// or netstat text to out: each group is a line of names and a line of
// values, both led by "Group:".
func parseProcNetCounters(text string, out map[string]uint64) error {
	lines := strings.Split(strings.TrimSpace(text), "\n")
	if len(lines)%2 != 0 {
		return fmt.Errorf("%d lines: want pairs of names and values", len(lines))
	}
	for i := 0; i < len(lines); i += 2 {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) != len(values) || len(names) == 0 || names[0] != values[0] {
			return fmt.Errorf("line %d: names and values do not pair", i+1)
		}
		group := strings.TrimSuffix(names[0], ":")
		if group != "Tcp" && group != "TcpExt" {
			continue
		}
		for j := 1; j < len(names); j++ {
			// Tcp's MaxConn is -1: not a counter.
			if v, err := strconv.ParseUint(values[j], 10, 64); err == nil {
				out[group+"."+names[j]] = v
			}
		}
	}
	return nil
}
