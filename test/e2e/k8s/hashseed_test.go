// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/penaltybox/penaltybox/internal/testnet"
	pbk8s "github.com/penaltybox/penaltybox/pkg/k8s"
)

// TestHashSeedIsTheClusters: agents starting together, with the shipped
// RBAC, agree on one flow-hash seed: the first creates the Secret, every
// other one reads it, and a later one reads the same. The agents' role
// reads that Secret and no other.
func TestHashSeedIsTheClusters(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	topo := testnet.New(t, testnet.Options{Backends: 1})
	c := startCluster(t, topo.Node)
	if _, err := c.kubectl("apply", "-f", filepath.Join(repoRoot, "deploy", "namespace.yaml"),
		"-f", filepath.Join(repoRoot, "deploy", "rbac.yaml")); err != nil {
		t.Fatal(err)
	}
	const ns = "penaltybox-system"
	agent, err := kubernetes.NewForConfig(c.RestConfig(c.AgentToken))
	if err != nil {
		t.Fatal(err)
	}
	seeds := make([]uint32, 6)
	errs := make([]error, len(seeds))
	var wg sync.WaitGroup
	for i := range seeds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			seeds[i], errs[i] = pbk8s.HashSeed(ctx, agent, ns)
		}()
	}
	wg.Wait()
	for i := range seeds {
		if errs[i] != nil {
			t.Fatalf("agent %d: %v", i, errs[i])
		}
		if seeds[i] == 0 || seeds[i] != seeds[0] {
			t.Fatalf("seeds %v: the agents disagree", seeds)
		}
	}
	later, err := pbk8s.HashSeed(ctx, agent, ns)
	if err != nil || later != seeds[0] {
		t.Fatalf("a later agent's seed %d (%v), want %d", later, err, seeds[0])
	}
	s, err := c.Admin.CoreV1().Secrets(ns).Get(ctx, pbk8s.HashSeedSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Data[pbk8s.HashSeedKey]) != 32 || pbk8s.SeedOf(s.Data[pbk8s.HashSeedKey]) != seeds[0] {
		t.Fatalf("secret %v does not hold the seed", s.Data)
	}
	// Another Secret in the namespace is not the agents' to read.
	if _, err := c.Admin.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "other"},
		StringData: map[string]string{"x": "y"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.CoreV1().Secrets(ns).Get(ctx, "other", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agent read another Secret: %v", err)
	}
}
