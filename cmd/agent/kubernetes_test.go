// SPDX-License-Identifier: Apache-2.0

package main

import (
	"reflect"
	"strings"
	"testing"
	"time"
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
		{args: []string{"--config", "x.yaml", "--syn-guard-rate", "0"}},
		{args: []string{"--config", "x.yaml", "--syn-guard-rate", "2k"}, wantErr: `-syn-guard-rate: want an integer from 0 to 1000000, got "2k"`},
		{args: []string{"--config", "x.yaml", "--syn-guard-rate", "1000001"}, wantErr: "want an integer from 0 to 1000000"},
		{args: []string{"--config", "x.yaml", "--syn-guard-trust", "0s"}, wantErr: "--syn-guard-trust 0s: must be positive"},
		{args: []string{"--config", "x.yaml", "--conntrack-size", "4k"}, wantErr: "want a positive integer"},
		{args: []string{"--config", "x.yaml", "--xdp-mode", "generic"}},
		{args: []string{"--config", "x.yaml", "--xdp-mode", "drv"}, wantErr: `--xdp-mode: "drv": want auto, native or generic`},
		{args: []string{"--config", "x.yaml", "--tracker-memory", "256Mi"}},
		{args: []string{"--config", "x.yaml", "--tracker-memory", "1048576"}},
		{args: []string{"--config", "x.yaml", "--tracker-memory", "1Ki"}, wantErr: `-tracker-memory: want a quantity from 1Mi to 16Gi, got "1Ki"`},
		{args: []string{"--config", "x.yaml", "--tracker-memory", "lots"}, wantErr: `want a quantity from 1Mi to 16Gi, got "lots"`},
		{args: []string{"--config", "x.yaml", "--tracker-memory", "1Ti"}, wantErr: "want a quantity from 1Mi to 16Gi"},
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

// The HTTP addresses: metrics on every interface (standalone's old
// default), the admin views on loopback only, or nowhere.
func TestParseFlagsHTTP(t *testing.T) {
	o, err := parseFlags([]string{"--config", "x.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	if o.metricsAddr != ":9464" || o.adminAddr != "127.0.0.1:9465" || o.trackerMemory != 64<<20 {
		t.Errorf("defaults: metrics %q admin %q tracker memory %d", o.metricsAddr, o.adminAddr, o.trackerMemory)
	}
	o, err = parseFlags([]string{"--config", "x.yaml", "--metrics-addr", "[198.18.0.1]:9464", "--admin-addr", ""})
	if err != nil {
		t.Fatal(err)
	}
	if o.metricsAddr != "[198.18.0.1]:9464" || o.adminAddr != "" {
		t.Errorf("metrics %q admin %q", o.metricsAddr, o.adminAddr)
	}
}

func TestParseFlagsSYNGuard(t *testing.T) {
	o, err := parseFlags([]string{"--config", "x.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	if o.synGuard.Rate != 2000 || o.synGuard.Burst != 200 || o.synGuard.Trust != time.Hour || o.synGuard.ArmRate != 20000 {
		t.Errorf("default SYN guard %+v, want 2000/s, 200 at once, trust 1h, armed at 20000/s", o.synGuard)
	}
	o, err = parseFlags([]string{"--config", "x.yaml", "--syn-guard-rate", "5"})
	if err != nil {
		t.Fatal(err)
	}
	if o.synGuard.Rate != 5 || o.synGuard.Burst != 1 {
		t.Errorf("SYN guard %+v, want 5/s, 1 at once", o.synGuard)
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
