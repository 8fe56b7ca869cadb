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

// The agent names its version and revision to the API server.
func TestClientsUserAgent(t *testing.T) {
	got := make(chan string, 8)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.UserAgent()
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"major":"1","minor":"37","gitVersion":"v1.37.2"}`))
	}))
	defer srv.Close()
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kc, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: `+srv.URL+`}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := NewClients(kc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Core.Discovery().ServerVersion(); err != nil {
		t.Fatal(err)
	}
	want := "penaltybox-agent/" + version.Version() + " (" + version.Revision() + ")"
	if ua := <-got; ua != want {
		t.Errorf("User-Agent %q, want %q", ua, want)
	}
}
