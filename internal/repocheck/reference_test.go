// SPDX-License-Identifier: Apache-2.0

package repocheck

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"
	"sigs.k8s.io/yaml"

	"github.com/penaltybox/penaltybox/bpf"
)

// docs/reference/maps.md lists every map of the XDP program as its
// compiled object declares it: type, key and value (their BTF types, as
// bpftool prints them), entries (the flags that size them at load time
// aside). Generated: `make docs`; this test fails when it is stale.
func TestMapsReference(t *testing.T) {
	spec, err := bpf.LoadLb()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for n := range spec.Maps {
		if strings.HasPrefix(n, ".") {
			continue // .rodata, .bss: the program's globals
		}
		names = append(names, n)
	}
	slices.Sort(names)
	typeName := func(t btf.Type) string {
		if t == nil {
			return ""
		}
		if n := t.TypeName(); n != "" {
			switch t.(type) {
			case *btf.Struct:
				return "struct " + n
			case *btf.Union:
				return "union " + n
			}
			return n
		}
		return fmt.Sprintf("%T", t)
	}
	var b strings.Builder
	b.WriteString("| map | type | key | value | entries (compiled) |\n| --- | --- | --- | --- | --- |\n")
	for _, n := range names {
		m := spec.Maps[n]
		key, value := typeName(m.Key), typeName(m.Value)
		if m.InnerMap != nil {
			value = "map: " + m.InnerMap.Type.String() + " of " + typeName(m.InnerMap.Value)
		}
		if key == "" {
			key = fmt.Sprintf("%d bytes", m.KeySize)
		}
		if value == "" {
			value = fmt.Sprintf("%d bytes", m.ValueSize)
		}
		fmt.Fprintf(&b, "| `%s` | %s | `%s` | `%s` | %d |\n", n, m.Type, key, value, m.MaxEntries)
	}
	CheckRegion(t, "../../docs/reference/maps.md", "maps", b.String())
}

// docs/reference/backendpolicy.md lists every field of the BackendPolicy
// CRD (deploy/backendpolicy-crd.yaml, which controller-gen generates from
// pkg/apis/policy/v1alpha1) with its type, bounds and description.
// Generated: `make docs`; this test fails when it is stale.
func TestBackendPolicyReference(t *testing.T) {
	b, err := os.ReadFile("../../deploy/backendpolicy-crd.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var crd struct {
		Spec struct {
			Versions []struct {
				Name   string `json:"name"`
				Schema struct {
					OpenAPIV3Schema prop `json:"openAPIV3Schema"`
				} `json:"schema"`
			} `json:"versions"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(b, &crd); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	out.WriteString("| field | type | bounds | description |\n| --- | --- | --- | --- |\n")
	root := crd.Spec.Versions[0].Schema.OpenAPIV3Schema
	for _, top := range []string{"spec", "status"} {
		walk(&out, top, root.Properties[top], slices.Contains(root.Required, top))
	}
	CheckRegion(t, "../../docs/reference/backendpolicy.md", "backendpolicy", out.String())
}

type prop struct {
	Type                   string          `json:"type"`
	Description            string          `json:"description"`
	Properties             map[string]prop `json:"properties"`
	Items                  *prop           `json:"items"`
	Required               []string        `json:"required"`
	Enum                   []any           `json:"enum"`
	Minimum                *float64        `json:"minimum"`
	Maximum                *float64        `json:"maximum"`
	ExclusiveMinimum       bool            `json:"exclusiveMinimum"`
	ExclusiveMaximum       bool            `json:"exclusiveMaximum"`
	MinItems               *int            `json:"minItems"`
	MaxItems               *int            `json:"maxItems"`
	MinLength              *int            `json:"minLength"`
	MaxLength              *int            `json:"maxLength"`
	Pattern                string          `json:"pattern"`
	Format                 string          `json:"format"`
	XKubernetesValidations []struct {
		Message string `json:"message"`
	} `json:"x-kubernetes-validations"`
}

func walk(out *strings.Builder, path string, p prop, required bool) {
	typ := p.Type
	if p.Items != nil {
		typ = "[]" + p.Items.Type
	}
	if p.Format != "" {
		typ += " (" + p.Format + ")"
	}
	if required {
		typ += ", required"
	}
	var bounds []string
	num := func(f float64) string { return strings.TrimSuffix(fmt.Sprintf("%g", f), ".0") }
	if p.Minimum != nil {
		op := "≥"
		if p.ExclusiveMinimum {
			op = ">"
		}
		bounds = append(bounds, op+" "+num(*p.Minimum))
	}
	if p.Maximum != nil {
		op := "≤"
		if p.ExclusiveMaximum {
			op = "<"
		}
		bounds = append(bounds, op+" "+num(*p.Maximum))
	}
	enum := p.Enum
	if p.Items != nil && len(p.Items.Enum) > 0 {
		enum = p.Items.Enum
	}
	if len(enum) > 0 {
		var es []string
		for _, e := range enum {
			es = append(es, fmt.Sprintf("`%v`", e))
		}
		bounds = append(bounds, "one of "+strings.Join(es, ", "))
	}
	if p.MinItems != nil {
		bounds = append(bounds, fmt.Sprintf("at least %d items", *p.MinItems))
	}
	if p.MaxItems != nil {
		bounds = append(bounds, fmt.Sprintf("at most %d items", *p.MaxItems))
	}
	if p.MaxLength != nil {
		bounds = append(bounds, fmt.Sprintf("at most %d characters", *p.MaxLength))
	}
	if p.Pattern != "" {
		bounds = append(bounds, "pattern `"+p.Pattern+"`")
	}
	for _, v := range p.XKubernetesValidations {
		bounds = append(bounds, v.Message)
	}
	fmt.Fprintf(out, "| `%s` | %s | %s | %s |\n", path, Cell(typ), Cell(strings.Join(bounds, "; ")), Cell(p.Description))
	sub := p.Properties
	req := p.Required
	if p.Items != nil && p.Items.Properties != nil {
		sub, req = p.Items.Properties, p.Items.Required
		path += "[]"
	}
	var keys []string
	for k := range sub {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		walk(out, path+"."+k, sub[k], slices.Contains(req, k))
	}
}
