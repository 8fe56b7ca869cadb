// SPDX-License-Identifier: Apache-2.0

package clusterrig

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// ChartRelease is the Helm release InstallChart makes.
const ChartRelease = "penaltybox"

// InstallChart installs the agent from charts/penaltybox as
// docs/install.md says, with only the image overridden: the namespace
// first (labelled for the privileged Pod Security level, which Helm's
// --create-namespace cannot do), then `helm install`, and waits for the
// agent's pod to be Ready.
func (r *Rig) InstallChart(ctx context.Context) error {
	if _, err := r.Kubectl(ctx, "apply", "-f", filepath.Join(r.Root, "deploy/namespace.yaml")); err != nil {
		return err
	}
	if _, err := r.Helm(ctx, "install", ChartRelease, filepath.Join(r.Root, "charts/penaltybox"),
		"--namespace", AgentNamespace,
		"--set", "image.repository="+AgentImage+",image.tag="+AgentTag,
		"--wait", "--timeout", "180s"); err != nil {
		return err
	}
	_, err := r.Kubectl(ctx, "-n", AgentNamespace, "rollout", "status", AgentDaemonSet, "--timeout=180s")
	return err
}

// UninstallChart removes the release as docs/install.md says (`helm
// uninstall --wait`), and waits until the agents' pods are gone: helm
// waits for the release's objects, not for the pods the DaemonSet leaves
// to the garbage collector, and each agent drains and removes its
// datapath before its pod goes (up to --uninstall-drain).
func (r *Rig) UninstallChart(ctx context.Context) error {
	if _, err := r.Helm(ctx, "uninstall", ChartRelease, "--namespace", AgentNamespace, "--wait", "--timeout", "120s"); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	var left string
	if err := Wait(wctx, func() bool {
		out, err := r.Kubectl(wctx, "-n", AgentNamespace, "get", "pods", "-l", "app.kubernetes.io/name=penaltybox", "-o", "name")
		left = strings.TrimSpace(out)
		return err == nil && left == ""
	}); err != nil {
		return fmt.Errorf("the agents' pods are not gone after helm uninstall: %q: %w", left, err)
	}
	return nil
}

// Helm runs helm (scripts/helm-tools.sh's, cached) on the node, as the
// cluster's admin, with its configuration and cache under the cluster's
// directory.
func (r *Rig) Helm(ctx context.Context, args ...string) (string, error) {
	bin, err := r.script(ctx, "scripts/helm-tools.sh")
	if err != nil {
		return "", err
	}
	lines := strings.Split(strings.TrimSpace(bin), "\n")
	helm := filepath.Join(lines[len(lines)-1], "helm")
	home := filepath.Join(r.Dir, "helm")
	if err := os.MkdirAll(home, 0o700); err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, filepath.Join(r.Root, "scripts/cluster.sh"),
		append([]string{"exec", "env", "HELM_CONFIG_HOME=" + home, "HELM_CACHE_HOME=" + home, "HELM_DATA_HOME=" + home,
			helm, "--kubeconfig", r.AdminKubeconfig()}, args...)...)
	cmd.Env = r.env()
	cmd.WaitDelay = 5 * time.Second
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("helm %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}
