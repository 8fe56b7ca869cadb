package main

import (
	"context"
	"errors"
	"log/slog"
)

// runKubernetes is the agent fed by the Kubernetes API (--node-name).
func runKubernetes(ctx context.Context, o options, log *slog.Logger) error {
	return errors.New("kubernetes mode is not implemented yet")
}
