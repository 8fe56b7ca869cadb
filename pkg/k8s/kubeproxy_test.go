package k8s

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestKubeProxyMode(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/proxyMode" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte("nftables"))
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	if m, err := KubeProxyMode(context.Background(), addr); err != nil || m != "nftables" {
		t.Errorf("mode %q, %v", m, err)
	}
	srv.Config.Handler = http.NotFoundHandler()
	if m, err := KubeProxyMode(context.Background(), addr); err == nil {
		t.Errorf("a 404 read as mode %q", m)
	}
	srv.Close()
	if _, err := KubeProxyMode(context.Background(), addr); err == nil {
		t.Error("no kube-proxy, no error")
	}
}
