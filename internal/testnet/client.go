// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"
)

// Class is the outcome class of one connection attempt.
type Class int

const (
	OK             Class = iota // connected and got a 200 response
	Refused                     // connect got RST (ECONNREFUSED)
	ConnectTimeout              // connect did not finish within the connect timeout
	Timeout                     // connected, but the response did not arrive in time
	Reset                       // connected, then reset (ECONNRESET/EPIPE)
	Unreachable                 // ICMP host/net unreachable (e.g. a VIP with no load balancer)
	Other                       // anything else (EOF without response, non-200, ...)
	NotStarted                  // load generator: concurrency cap reached at the scheduled time
)

// Classes lists every class in order.
var Classes = []Class{OK, Refused, ConnectTimeout, Timeout, Reset, Unreachable, Other, NotStarted}

func (c Class) String() string {
	switch c {
	case OK:
		return "ok"
	case Refused:
		return "refused"
	case ConnectTimeout:
		return "connect-timeout"
	case Timeout:
		return "timeout"
	case Reset:
		return "reset"
	case Unreachable:
		return "unreachable"
	case Other:
		return "other"
	case NotStarted:
		return "not-started"
	}
	return fmt.Sprintf("Class(%d)", int(c))
}

// Failed reports whether the class is a failure of a started attempt.
func (c Class) Failed() bool { return c != OK && c != NotStarted }

// Classify maps an error from DialContext, HTTPGet or a connection's
// Read/Write to its Class. A timeout is ConnectTimeout if it happened while
// dialing (a *net.OpError with Op "dial" in the chain), Timeout otherwise.
func Classify(err error) Class {
	if err == nil {
		return OK
	}
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return Refused
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return Reset
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return Unreachable
	}
	var ne net.Error
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout()) {
		var oe *net.OpError
		if errors.As(err, &oe) && oe.Op == "dial" {
			return ConnectTimeout
		}
		return Timeout
	}
	return Other
}

// HTTPClient returns an HTTP client whose connections are created inside
// the namespace: a fresh connection per request (keep-alives disabled), no
// proxy (environment proxy settings would otherwise apply), connect phase
// bounded by connectTimeout (0 = only the request's context).
func (n *NS) HTTPClient(connectTimeout time.Duration) *http.Client {
	return &http.Client{Transport: n.httpTransport(connectTimeout, true)}
}

func (n *NS) httpTransport(connectTimeout time.Duration, noKeepAlive bool) *http.Transport {
	d := n.Dialer(connectTimeout)
	maxIdle := 0 // default (2)
	if noKeepAlive {
		maxIdle = -1
	}
	return &http.Transport{
		Proxy:               nil,
		DialContext:         d.DialContext,
		DisableKeepAlives:   noKeepAlive,
		DisableCompression:  true,
		MaxIdleConnsPerHost: maxIdle,
		ForceAttemptHTTP2:   false,
	}
}

// HTTPGet GETs url over a fresh connection made inside the namespace and
// returns the body of a 200 response. connectTimeout bounds the connect
// phase; ctx bounds everything. Use Classify on the error.
func (n *NS) HTTPGet(ctx context.Context, url string, connectTimeout time.Duration) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	tr := n.httpTransport(connectTimeout, true)
	defer tr.CloseIdleConnections()
	resp, err := tr.RoundTrip(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return string(body), err
	}
	if resp.StatusCode != http.StatusOK {
		return string(body), fmt.Errorf("testnet: GET %s: %s", url, resp.Status)
	}
	return string(body), nil
}

// BackendOf returns the backend name in a Serve response body ("b1\n" →
// "b1").
func BackendOf(body string) string { return strings.TrimSpace(body) }
