package main

import (
	"reflect"
	"strings"
	"testing"
)

// Exactly one mode: standalone (--config) or Kubernetes (--node-name).
func TestParseFlagsModes(t *testing.T) {
	tests := []struct {
		args    []string
		wantErr string
	}{
		{args: []string{"--config", "x.yaml"}},
		{args: []string{"--node-name", "n1"}},
		{args: []string{"--node-name", "n1", "--kubeconfig", "/k"}},
		{args: nil, wantErr: "--config FILE (standalone) or --node-name NODE (Kubernetes) is required"},
		{args: []string{"--config", "x.yaml", "--node-name", "n1"}, wantErr: "exclusive"},
		{args: []string{"--node-name", "n1", "--pod-interfaces", "cali*,[x"}, wantErr: "--pod-interfaces"},
		{args: []string{"--node-name", "n1", "--node-interfaces", "eth[0"}, wantErr: "--node-interfaces"},
		{args: []string{"--node-name", "n1", "--tunnel-interfaces", "flannel.[1"}, wantErr: "--tunnel-interfaces"},
	}
	for _, tt := range tests {
		_, err := parseFlags(tt.args)
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%v: %v", tt.args, err)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("%v: error %v, want one containing %q", tt.args, err, tt.wantErr)
		}
	}
}

func TestParseFlagsInterfaces(t *testing.T) {
	o, err := parseFlags([]string{"--node-name", "n1"})
	if err != nil {
		t.Fatal(err)
	}
	if !o.nodeIfacesAuto || len(o.nodeIfaces) != 0 || len(o.podIfaces) == 0 ||
		!reflect.DeepEqual(o.tunnelIfaces, []string{"flannel.*", "flannel-v6.*", "vxlan.calico", "vxlan-v6.calico"}) {
		t.Errorf("defaults: node %v auto %v pods %v tunnels %v; want auto and the CNI patterns",
			o.nodeIfaces, o.nodeIfacesAuto, o.podIfaces, o.tunnelIfaces)
	}
	o, err = parseFlags([]string{"--node-name", "n1", "--node-interfaces", "", "--pod-interfaces", "cl*, b*", "--tunnel-interfaces", ""})
	if err != nil {
		t.Fatal(err)
	}
	if o.nodeIfacesAuto || len(o.nodeIfaces) != 0 || !reflect.DeepEqual(o.podIfaces, []string{"cl*", "b*"}) || len(o.tunnelIfaces) != 0 {
		t.Errorf("node %v auto %v pods %v tunnels %v", o.nodeIfaces, o.nodeIfacesAuto, o.podIfaces, o.tunnelIfaces)
	}
}
