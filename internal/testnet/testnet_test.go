package testnet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

const connectTimeout = 300 * time.Millisecond

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func netnsList(t *testing.T) string {
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	return string(out)
}

func get(t *testing.T, topo *Topology, url string) (string, Class, error) {
	t.Helper()
	body, err := topo.Client.HTTPGet(ctxT(t, 3*time.Second), url, connectTimeout)
	return body, Classify(err), err
}

func backendURL(i int) string { return fmt.Sprintf("http://198.18.%d.2/", i) }

// rawRequest connects to backend i and sends one GET, returning the
// connection (for Hold / reset checks) and the dial error.
func rawRequest(t *testing.T, topo *Topology, i int) (net.Conn, error) {
	t.Helper()
	c, err := topo.Client.Dialer(connectTimeout).DialContext(ctxT(t, 2*time.Second), "tcp", fmt.Sprintf("198.18.%d.2:80", i))
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); err != nil {
		return c, err
	}
	return c, nil
}

func TestTopology(t *testing.T) {
	topo := New(t, Options{Backends: 3})
	names := []string{topo.Node.Name, topo.Client.Name}
	for i, b := range topo.Backends {
		names = append(names, b.Name)
		if b.Name != "b"+strconv.Itoa(i+1) || b.Addr.String() != fmt.Sprintf("198.18.%d.2", i+1) {
			t.Fatalf("backend %d: name %s addr %s", i+1, b.Name, b.Addr)
		}
		if err := b.ServeHTTP(80); err != nil {
			t.Fatal(err)
		}
	}
	if got := strings.Join(topo.NodeIfaces(), ","); got != "cl0,b1,b2,b3" {
		t.Fatalf("node ifaces %s", got)
	}

	t.Run("Routing", func(t *testing.T) {
		for i := 1; i <= 3; i++ {
			body, class, err := get(t, topo, backendURL(i))
			if class != OK || body != fmt.Sprintf("b%d\n", i) {
				t.Errorf("GET %s = %q, %v (%s)", backendURL(i), body, err, class)
			}
		}
		// Plain routing, no NAT: the connection is 198.18.0.2 -> 198.18.1.2.
		c, err := topo.Client.DialContext(ctxT(t, time.Second), "tcp", "198.18.1.2:80")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if l, r := c.LocalAddr().String(), c.RemoteAddr().String(); !strings.HasPrefix(l, "198.18.0.2:") || r != "198.18.1.2:80" {
			t.Errorf("client connection %s -> %s", l, r)
		}
	})

	t.Run("VIPUnassigned", func(t *testing.T) {
		// No load balancer: the node has no route to the VIP and says so.
		_, class, err := get(t, topo, "http://"+VIP+"/")
		if class != Unreachable {
			t.Errorf("GET VIP: %v (%s), want unreachable", err, class)
		}
	})

	t.Run("KeepAlive", func(t *testing.T) {
		b := topo.Backend(3)
		before := b.Stats()
		tr := topo.Client.httpTransport(connectTimeout, false)
		defer tr.CloseIdleConnections()
		cl := &http.Client{Transport: tr}
		for i := 0; i < 3; i++ {
			resp, err := cl.Get(backendURL(3))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(body) != "b3\n" {
				t.Fatalf("body %q", body)
			}
		}
		after := b.Stats()
		if d := after.Accepted - before.Accepted; d != 1 {
			t.Errorf("keep-alive: %d connections for 3 requests", d)
		}
		if d := after.Requests - before.Requests; d != 3 {
			t.Errorf("requests +%d, want 3", d)
		}
	})

	b := topo.Backend(2)
	url := backendURL(2)
	t.Run("Refuse", func(t *testing.T) {
		if err := b.SetMode(Refuse); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, class, err := get(t, topo, url)
		if class != Refused {
			t.Errorf("refuse: %v (%s)", err, class)
		}
		if el := time.Since(start); el >= connectTimeout {
			t.Logf("note: refusal took %v", el) // the class is the assertion
		}
		if err := b.SetMode(Serve); err != nil {
			t.Fatal(err)
		}
		if body, class, err := get(t, topo, url); class != OK || body != "b2\n" {
			t.Errorf("serve after refuse: %q %v", body, err)
		}
	})

	t.Run("Blackhole", func(t *testing.T) {
		if err := b.SetMode(Blackhole); err != nil {
			t.Fatal(err)
		}
		acc := b.Accepted()
		for i := 0; i < 2; i++ {
			_, class, err := get(t, topo, url)
			if class != ConnectTimeout {
				t.Errorf("blackhole: %v (%s)", err, class)
			}
		}
		if b.Accepted() != acc {
			t.Errorf("blackhole: backend accepted %d connections", b.Accepted()-acc)
		}
		if out, _ := b.Run("nft", "list", "tables"); !strings.Contains(out, "pbtest") {
			t.Errorf("nft tables: %q", out)
		}
		if err := b.SetMode(Serve); err != nil {
			t.Fatal(err)
		}
		if out, _ := b.Run("nft", "list", "tables"); strings.Contains(out, "pbtest") {
			t.Errorf("nft table left after blackhole: %q", out)
		}
		if body, class, err := get(t, topo, url); class != OK || body != "b2\n" {
			t.Errorf("serve after blackhole: %q %v", body, err)
		}
	})

	t.Run("ResetAfterHandshake", func(t *testing.T) {
		if err := b.SetMode(ResetAfterHandshake); err != nil {
			t.Fatal(err)
		}
		before := b.Stats()
		_, class, err := get(t, topo, url)
		if class != Reset {
			t.Errorf("HTTPGet: %v (%s)", err, class)
		}
		// The handshake itself succeeds (the backend accepted), and the RST
		// follows at once: depending on timing the dialer already sees it
		// (connect: connection reset by peer, the same as Go's own dialer),
		// or the write of the request, or the first read. Either way:
		// Reset, and no data.
		c, err := rawRequest(t, topo, 2)
		if err == nil {
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			var n int
			n, err = c.Read(make([]byte, 100))
			if n != 0 {
				t.Errorf("read %d bytes after handshake", n)
			}
		}
		if Classify(err) != Reset {
			t.Errorf("raw connection: %v (%s)", err, Classify(err))
		}
		if d := b.Stats().Resets - before.Resets; d != 2 {
			t.Errorf("resets +%d, want 2", d)
		}
		if err := b.SetMode(Serve); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("Hold", func(t *testing.T) {
		if err := b.SetMode(Hold); err != nil {
			t.Fatal(err)
		}
		c, err := rawRequest(t, topo, 2)
		if err != nil {
			t.Fatalf("connect in hold mode: %v", err)
		}
		c2, err := rawRequest(t, topo, 2)
		if err != nil {
			t.Fatalf("connect in hold mode: %v", err)
		}
		// The read blocks: no answer within 200ms.
		c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); Classify(err) != Timeout {
			t.Errorf("read while held: %v", err)
		}
		// Held() counts connections once the accept loop has them.
		deadline := time.Now().Add(2 * time.Second)
		for b.Stats().Held < 2 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if h := b.Stats().Held; h != 2 {
			t.Fatalf("held %d, want 2", h)
		}
		if err := b.SetMode(Serve); err != nil { // does not release
			t.Fatal(err)
		}
		if n := b.ReleaseHeld(); n != 2 {
			t.Errorf("released %d, want 2", n)
		}
		for _, c := range []net.Conn{c, c2} {
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatalf("after release: %v", err)
			}
			body, _ := io.ReadAll(resp.Body)
			if string(body) != "b2\n" {
				t.Errorf("after release: %q", body)
			}
		}
		// CloseHeld closes instead; the request bytes are unread, so the
		// kernel answers the close with RST.
		b.SetMode(Hold)
		c3, err := rawRequest(t, topo, 2)
		if err != nil {
			t.Fatal(err)
		}
		deadline = time.Now().Add(2 * time.Second)
		for b.Stats().Held < 1 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if n := b.CloseHeld(); n != 1 {
			t.Errorf("closed %d held, want 1", n)
		}
		c3.SetReadDeadline(time.Now().Add(2 * time.Second))
		if _, err := c3.Read(make([]byte, 1)); Classify(err) != Reset {
			t.Errorf("read after CloseHeld: %v", err)
		}
		b.SetMode(Serve)
	})

	t.Run("UDPEcho", func(t *testing.T) {
		b1 := topo.Backend(1)
		if err := b1.ServeUDPEcho(5353); err != nil {
			t.Fatal(err)
		}
		c, err := topo.Client.DialContext(ctxT(t, time.Second), "udp", "198.18.1.2:5353")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		exchange := func() (string, error) {
			if _, err := c.Write([]byte("ping")); err != nil {
				return "", err
			}
			c.SetReadDeadline(time.Now().Add(time.Second))
			buf := make([]byte, 100)
			n, err := c.Read(buf)
			return string(buf[:n]), err
		}
		if got, err := exchange(); got != "b1\nping" {
			t.Errorf("echo: %q %v", got, err)
		}
		b1.SetMode(Refuse)
		if _, err := exchange(); Classify(err) != Refused {
			t.Errorf("udp refused: %v", err)
		}
		b1.SetMode(Serve)
		if got, err := exchange(); got != "b1\nping" {
			t.Errorf("echo after refuse: %q %v", got, err)
		}
	})

	t.Run("Load", func(t *testing.T) {
		ctx := ctxT(t, 20*time.Second)
		rs, err := Load(ctx, topo.Client, LoadSpec{
			Target: "198.18.1.2:80", Rate: 200, Count: 60,
			ConnectTimeout: connectTimeout, RequestTimeout: time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("serve: %v", rs)
		if len(rs) != 60 || rs.Count(OK) != 60 || rs.ByBackend()["b1"] != 60 {
			t.Errorf("serve: %v", rs)
		}
		for i, r := range rs {
			if r.Seq != i || r.Scheduled.IsZero() || r.Started.IsZero() {
				t.Fatalf("result %d: %+v", i, r)
			}
		}

		// Refused, then served: the first 20 fail, AfterFailures(20) is clean.
		topo.Backend(1).SetMode(Refuse)
		rs1, _ := Load(ctx, topo.Client, LoadSpec{Target: "198.18.1.2:80", Rate: 200, Count: 20, ConnectTimeout: connectTimeout})
		topo.Backend(1).SetMode(Serve)
		rs2, _ := Load(ctx, topo.Client, LoadSpec{Target: "198.18.1.2:80", Rate: 200, Count: 20, ConnectTimeout: connectTimeout})
		all := append(append(Results{}, rs1...), rs2...)
		if rs1.Count(Refused) != 20 || rs2.Count(OK) != 20 {
			t.Errorf("refuse/serve: %v / %v", rs1, rs2)
		}
		if after, ok := all.AfterFailures(20); !ok || after.Count(OK) != 20 || after.Failures() != 0 {
			t.Errorf("AfterFailures(20): %v %v", ok, after)
		}
		if _, ok := all.AfterFailures(21); ok {
			t.Errorf("AfterFailures(21) ok with 20 failures")
		}
		bk := all.Buckets(50 * time.Millisecond)
		total := 0
		for _, b := range bk {
			total += b.Total
		}
		if total != 40 {
			t.Errorf("buckets hold %d results, want 40", total)
		}

		// Connect-only attempts: L4 outcome without HTTP.
		acc := topo.Backend(2).Accepted()
		rs4, _ := Load(ctx, topo.Client, LoadSpec{Target: "198.18.2.2:80", Rate: 200, Count: 10, ConnectOnly: true})
		if rs4.Count(OK) != 10 {
			t.Errorf("connect-only: %v", rs4)
		}
		deadline := time.Now().Add(2 * time.Second)
		for topo.Backend(2).Accepted()-acc < 10 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if d := topo.Backend(2).Accepted() - acc; d != 10 {
			t.Errorf("connect-only: backend accepted %d, want 10", d)
		}

		// Blackholed with a concurrency cap of 4: each attempt occupies a
		// slot for the 300ms connect timeout, so at 100/s for 0.5s most
		// attempts find no free slot.
		topo.Backend(3).SetMode(Blackhole)
		rs3, _ := Load(ctx, topo.Client, LoadSpec{
			Target: "198.18.3.2:80", Rate: 100, Count: 50, Concurrency: 4,
			ConnectTimeout: connectTimeout,
		})
		topo.Backend(3).SetMode(Serve)
		t.Logf("blackhole: %v", rs3)
		ct, ns := rs3.Count(ConnectTimeout), rs3.Count(NotStarted)
		if ct+ns != 50 || ct < 4 || ns < 25 {
			t.Errorf("blackhole with cap 4: %v", rs3)
		}

		// A share refused at random: 30% of 400 is 120, ±40 is over four
		// standard deviations of the binomial draw.
		if err := topo.Backend(2).RefuseShare(0.3); err != nil {
			t.Fatal(err)
		}
		rs5, _ := Load(ctx, topo.Client, LoadSpec{Target: "198.18.2.2:80", Rate: 400, Count: 400, ConnectOnly: true})
		if n := rs5.Count(Refused); n < 80 || n > 160 || rs5.Count(OK)+n != 400 {
			t.Errorf("refuse share 0.3: %v", rs5)
		}
		if err := topo.Backend(2).RefuseShare(0); err != nil {
			t.Fatal(err)
		}
		if out, _ := topo.Backend(2).Run("nft", "list", "tables"); strings.Contains(out, shareTable) {
			t.Errorf("nft table left after refuse share 0: %q", out)
		}
		rs6, _ := Load(ctx, topo.Client, LoadSpec{Target: "198.18.2.2:80", Rate: 400, Count: 100, ConnectOnly: true})
		if rs6.Count(OK) != 100 {
			t.Errorf("refuse share 0: %v", rs6)
		}

		// Held SYN-ACKs: every connect takes at least the delay (a lower
		// bound, which no noise can break), and works.
		if err := topo.Backend(2).DelayHandshakes(60 * time.Millisecond); err != nil {
			t.Fatal(err)
		}
		rs7, _ := Load(ctx, topo.Client, LoadSpec{Target: "198.18.2.2:80", Rate: 100, Count: 20, ConnectOnly: true, ConnectTimeout: 3 * time.Second})
		for _, r := range rs7 {
			if r.Class != OK || r.Latency < 60*time.Millisecond {
				t.Errorf("delayed handshake: %v after %v", r.Class, r.Latency)
			}
		}
		if err := topo.Backend(2).DelayHandshakes(0); err != nil {
			t.Fatal(err)
		}
		rs8, _ := Load(ctx, topo.Client, LoadSpec{Target: "198.18.2.2:80", Rate: 100, Count: 20, ConnectOnly: true})
		if rs8.Count(OK) != 20 {
			t.Errorf("after the delay: %v", rs8)
		}
	})

	t.Run("Close", func(t *testing.T) {
		list := netnsList(t)
		for _, n := range []string{topo.Node.Name, topo.Client.Name} {
			if !strings.Contains(list, n) {
				t.Fatalf("%s missing before Close: %s", n, list)
			}
		}
		if err := topo.Close(); err != nil {
			t.Fatal(err)
		}
		if err := topo.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		list = netnsList(t)
		for _, ns := range topo.namespaces() {
			if strings.Contains(list, ns.Name) {
				t.Errorf("%s still listed after Close", ns.Name)
			}
		}
		if _, err := os.Stat(registryPath(topo.ID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("registry file left: %v", err)
		}
		if _, err := topo.Client.DialContext(context.Background(), "tcp", "198.18.1.2:80"); err == nil {
			t.Errorf("dial after Close succeeded")
		}
	})
}

func TestOptionsGRO(t *testing.T) {
	topo := New(t, XDPOptions(2))
	for _, l := range topo.Links {
		gro, tx, err := l.Peer.Features("eth0")
		if err != nil || !gro || tx {
			t.Errorf("%s eth0: gro=%v txcsum=%v err=%v", l.Peer.Name, gro, tx, err)
		}
		gro, tx, err = topo.Node.Features(l.Name)
		if err != nil || gro || !tx {
			t.Errorf("node %s: gro=%v txcsum=%v err=%v (node side must be untouched)", l.Name, gro, tx, err)
		}
	}
	topo.Backend(2).ServeHTTP(8080)
	body, err := topo.Client.HTTPGet(ctxT(t, 2*time.Second), "http://198.18.2.2:8080/", connectTimeout)
	if body != "b2\n" {
		t.Errorf("GET: %q %v", body, err)
	}
}

func TestParallelTopologies(t *testing.T) {
	a := New(t, Options{Backends: 1})
	b := New(t, Options{Backends: 1})
	if a.Node.Name == b.Node.Name {
		t.Fatal("names collide")
	}
	a.Backend(1).ServeHTTP(80)
	// b's backend serves nothing: refused there, served in a.
	if _, err := b.Client.HTTPGet(ctxT(t, 2*time.Second), backendURL(1), connectTimeout); Classify(err) != Refused {
		t.Errorf("b: %v", err)
	}
	if body, err := a.Client.HTTPGet(ctxT(t, 2*time.Second), backendURL(1), connectTimeout); body != "b1\n" {
		t.Errorf("a: %q %v", body, err)
	}
}

func TestCleanupStale(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	live := New(t, Options{Backends: 1})

	// A PID that is certainly dead: a child we started and reaped.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	id := strconv.FormatInt(int64(pid), 36) + "_zz"
	dead := []string{nsName(id, "node"), nsName(id, "b1")}
	for _, n := range dead {
		if err := createNetns(n); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { deleteNetns(n) })
	}
	os.MkdirAll(RegistryDir, 0o755)
	os.WriteFile(registryPath(id), []byte(fmt.Sprintf(`{"pid":%d,"start_time":"1","namespaces":["%s","%s"]}`, pid, dead[0], dead[1])), 0o644)

	removed, err := CleanupStale()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(removed, ",") != strings.Join(dead, ",") && strings.Join(removed, ",") != dead[1]+","+dead[0] {
		// Other dead leftovers may be removed too; ours must be among them.
		for _, n := range dead {
			if !strings.Contains(","+strings.Join(removed, ",")+",", ","+n+",") {
				t.Errorf("%s not removed (removed %v)", n, removed)
			}
		}
	}
	list := netnsList(t)
	for _, n := range dead {
		if strings.Contains(list, n) {
			t.Errorf("%s still listed", n)
		}
	}
	if _, err := os.Stat(registryPath(id)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale registry file left")
	}
	for _, ns := range live.namespaces() {
		if !strings.Contains(list, ns.Name) {
			t.Errorf("live namespace %s removed", ns.Name)
		}
	}
}

func TestDoRestoresThreads(t *testing.T) {
	topo := New(t, Options{Backends: 1})
	host, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		var inside string
		err := topo.Backend(1).Do(func() error {
			var err error
			inside, err = os.Readlink("/proc/thread-self/ns/net")
			return err
		})
		if err != nil || inside == host {
			t.Fatalf("Do ran in %s (host %s): %v", inside, host, err)
		}
	}
	if err := topo.Client.Do(func() error { panic("boom") }); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("panic in Do: %v", err)
	}
	// Every thread the scheduler may hand out must be back in the host
	// namespace: sample many.
	errc := make(chan error, 200)
	for i := 0; i < 200; i++ {
		go func() {
			ns, err := os.Readlink("/proc/thread-self/ns/net")
			if err == nil && ns != host {
				err = fmt.Errorf("goroutine ran in %s, host is %s", ns, host)
			}
			errc <- err
		}()
	}
	for i := 0; i < 200; i++ {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
}
