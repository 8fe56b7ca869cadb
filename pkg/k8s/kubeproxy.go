package k8s

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// KubeProxyMode asks the node's kube-proxy which mode it runs in
// (iptables, ipvs, nftables) at its metrics server's /proxyMode, addr
// being its --metrics-bind-address. penaltybox leaves every Service it
// does not serve, and every new flow while its dead-man's switch has
// tripped, to kube-proxy: without one (or a replacement) those go nowhere.
func KubeProxyMode(ctx context.Context, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/proxyMode", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64))
	if err != nil {
		return "", err
	}
	mode := strings.TrimSpace(string(b))
	if resp.StatusCode != http.StatusOK || mode == "" {
		return "", fmt.Errorf("/proxyMode: %s %q", resp.Status, mode)
	}
	return mode, nil
}
