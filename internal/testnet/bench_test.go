// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"net"
	"testing"
	"time"
)

// benchTarget starts an accept-and-close server on backend 1 port 7 and
// returns its address.
func benchTarget(b *testing.B) (*Topology, string) {
	topo := New(b, Options{Backends: 1})
	ln, err := topo.Backend(1).Listen("tcp4", ":7")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return topo, "198.18.1.2:7"
}

// closeNow closes without TIME_WAIT (RST), so b.N is not limited by the
// client's port range.
func closeNow(c net.Conn) {
	c.(*net.TCPConn).SetLinger(0)
	c.Close()
}

// BenchmarkDial measures NS.DialContext + close through the node: the
// pooled-socket path used by HTTPGet, Load and the e2e tests.
func BenchmarkDial(b *testing.B) {
	topo, addr := benchTarget(b)
	ctx := context.Background()
	d := topo.Client.Dialer(time.Second)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		closeNow(c)
	}
}

// BenchmarkDialParallel is BenchmarkDial from GOMAXPROCS goroutines.
func BenchmarkDialParallel(b *testing.B) {
	topo, addr := benchTarget(b)
	ctx := context.Background()
	d := topo.Client.Dialer(time.Second)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			c, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				b.Error(err)
				return
			}
			closeNow(c)
		}
	})
}

// BenchmarkDialInThread is the naive alternative: each dial runs the
// standard net.Dialer on a goroutine locked into the namespace (NS.Do).
func BenchmarkDialInThread(b *testing.B) {
	topo, addr := benchTarget(b)
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c, err := topo.Client.dialInThread(ctx, "tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		closeNow(c)
	}
}

// BenchmarkDialBaseline is the floor: the standard net.Dialer in a loop on
// one thread that stays inside the namespace (no per-dial namespace cost).
func BenchmarkDialBaseline(b *testing.B) {
	topo, addr := benchTarget(b)
	ctx := context.Background()
	b.ResetTimer()
	err := topo.Client.Do(func() error {
		var d net.Dialer
		for i := 0; i < b.N; i++ {
			c, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				return err
			}
			closeNow(c)
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkDialLoopbackFloor dials 127.0.0.1 inside one namespace: the
// machine's floor for a TCP handshake + close, with no veth or forwarding.
func BenchmarkDialLoopbackFloor(b *testing.B) {
	topo := New(b, Options{Backends: 1})
	ln, err := topo.Client.Listen("tcp4", "127.0.0.1:7")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	ctx := context.Background()
	d := topo.Client.Dialer(time.Second)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c, err := d.DialContext(ctx, "tcp", "127.0.0.1:7")
		if err != nil {
			b.Fatal(err)
		}
		closeNow(c)
	}
}
