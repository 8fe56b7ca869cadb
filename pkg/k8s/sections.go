// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
)

// withSections adds to base (the Service's settings: annotations, then
// the policy that targets the whole Service) the settings of each port
// that a BackendPolicy targets by sectionName: that policy's fields over
// base, field by field, as GEP-713 has a more specific target's policy
// win over the whole target's. The oldest policy naming a port is in
// force on it (the others are Conflicted). While it is invalid the port
// keeps base, and it is announced once, by a log line and the
// invalid-settings metric; its status says why. Called with mu held.
func (c *Controller) withSections(svc *corev1.Service, key string, base Settings, e *entry) Settings {
	targeting := c.targetingLocked(key)
	if len(targeting) == 0 {
		e.badSections = nil
		return base
	}
	out := base
	out.Ports = nil
	for _, sp := range svc.Spec.Ports {
		port := sp.Name
		if port == "" {
			continue // an unnamed port cannot be a section
		}
		p := WinnerFor(targeting, key, port)
		if p == nil {
			delete(e.badSections, port)
			continue
		}
		s, err := ApplyPolicy(p, base)
		if err != nil {
			if id := fmt.Sprintf("%s@%d", p.Key(), p.Generation); e.badSections[port] != id {
				if e.badSections == nil {
					e.badSections = map[string]string{}
				}
				e.badSections[port] = id
				c.log.Warn("invalid BackendPolicy for a Service port; the Service's settings stay in force on it",
					"service", key, "port", port, "policy", p.Key(), "err", err)
				if c.metrics.InvalidSettings != nil {
					c.metrics.InvalidSettings.WithLabelValues(key, PolicyKind+" "+p.Key()).Inc()
				}
			}
			continue
		}
		delete(e.badSections, port)
		if out.Ports == nil {
			out.Ports = map[string]Settings{}
		}
		s.Ports = nil
		out.Ports[port] = s
	}
	return out
}
