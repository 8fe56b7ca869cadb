// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/penaltybox/penaltybox/internal/version"
)

// The agent names its version and revision to the API server, and asks
// for gzip only when told to. Over TLS, as every API server is: over plain
// HTTP client-go uses Go's default transport, which ignores the setting.
func TestClientsUserAgentAndCompression(t *testing.T) {
	type seen struct{ agent, encoding string }
	got := make(chan seen, 8)
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- seen{r.UserAgent(), r.Header.Get("Accept-Encoding")}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"major":"1","minor":"37","gitVersion":"v1.37.2"}`))
	}))
	defer srv.Close()
	for _, tc := range []struct {
		compression bool
		kubeconfig  string // extra cluster fields
		encoding    string
	}{
		{compression: false, encoding: ""},
		{compression: true, encoding: "gzip"},
		// The kubeconfig's own setting wins over the flag.
		{compression: true, kubeconfig: ", disable-compression: true", encoding: ""},
	} {
		kc := filepath.Join(t.TempDir(), "kubeconfig")
		if err := os.WriteFile(kc, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: `+srv.URL+`, insecure-skip-tls-verify: true`+tc.kubeconfig+`}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := NewClients(kc, tc.compression)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Core.Discovery().ServerVersion(); err != nil {
			t.Fatal(err)
		}
		want := "penaltybox-agent/" + version.Version() + " (" + version.Revision() + ")"
		s := <-got
		if s.agent != want {
			t.Errorf("User-Agent %q, want %q", s.agent, want)
		}
		if s.encoding != tc.encoding {
			t.Errorf("compression %v, kubeconfig %q: Accept-Encoding %q, want %q", tc.compression, tc.kubeconfig, s.encoding, tc.encoding)
		}
	}
}
