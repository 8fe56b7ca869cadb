// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"crypto/rand"
	"fmt"
	"hash/fnv"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// HashSeedSecret is the Secret, in the agents' namespace, whose key
// HashSeedKey seeds every node's flow hash: a client that knows the Maglev
// tables still cannot pick its backend by picking its source port, and
// every node picks alike.
const (
	HashSeedSecret = "penaltybox-hash-seed"
	HashSeedKey    = "seed"
)

// HashSeed reads the cluster's flow-hash seed from the Secret, creating it
// with 32 random bytes when it is missing: the first agent to start makes
// it, and every other one, racing or later, reads the one that won.
func HashSeed(ctx context.Context, c kubernetes.Interface, namespace string) (uint32, error) {
	secrets := c.CoreV1().Secrets(namespace)
	for range 3 {
		s, err := secrets.Get(ctx, HashSeedSecret, metav1.GetOptions{})
		if err == nil {
			b := s.Data[HashSeedKey]
			if len(b) < 4 {
				return 0, fmt.Errorf("secret %s/%s: key %q holds %d bytes, want at least 4", namespace, HashSeedSecret, HashSeedKey, len(b))
			}
			return SeedOf(b), nil
		}
		if !apierrors.IsNotFound(err) {
			return 0, fmt.Errorf("secret %s/%s: %w", namespace, HashSeedSecret, err)
		}
		b := make([]byte, 32)
		if _, err := rand.Read(b); err != nil {
			return 0, err
		}
		_, err = secrets.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: HashSeedSecret, Namespace: namespace,
				Labels: map[string]string{"app.kubernetes.io/name": "penaltybox"}},
			Type: corev1.SecretTypeOpaque,
			Data: map[string][]byte{HashSeedKey: b},
		}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return 0, fmt.Errorf("create secret %s/%s: %w", namespace, HashSeedSecret, err)
		}
	}
	return 0, fmt.Errorf("secret %s/%s: created and gone again", namespace, HashSeedSecret)
}

// SeedOf folds a secret of any length into the datapath's 32-bit seed
// (never 0, which the agent reads as "none set").
func SeedOf(b []byte) uint32 {
	h := fnv.New32a()
	h.Write(b)
	return h.Sum32() | 1
}
