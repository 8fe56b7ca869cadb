package maps

import "testing"

// The strings are metric label values: they must not change.
func TestBackendStateStrings(t *testing.T) {
	for st, want := range map[BackendState]string{
		BackendActive: "active", BackendProbation: "probation",
		BackendEjected: "ejected", BackendRemoved: "removed", 9: "state(9)",
	} {
		if got := st.String(); got != want {
			t.Errorf("BackendState(%d).String() = %q, want %q", uint8(st), got, want)
		}
	}
}
