package config

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

// The raw types mirror the file as written. Optional fields are pointers
// (or nil slices) so that "unset" differs from a zero value: merging
// defaults depends on it (jitterRatio: 0 overrides, an absent jitterRatio
// inherits). Adding a field is: add it here with its json tag, then read it
// in the matching parse/resolve function. The shape check below learns the
// new field from the tag by itself.

type rawConfig struct {
	Interfaces         []string     `json:"interfaces"`
	RedirectInterfaces []string     `json:"redirectInterfaces"`
	Maglev             *rawMaglev   `json:"maglev"`
	Defaults           *rawDefaults `json:"defaults"`
	Services           []rawService `json:"services"`
}

type rawMaglev struct {
	TableSize *int `json:"tableSize"`
}

// rawDefaults holds what a service inherits unless it sets its own.
type rawDefaults struct {
	FailureAccrual         *rawAccrual `json:"failureAccrual"`
	MaxInflight            *int64      `json:"maxInflight"`
	MaxInflightPerEndpoint *int64      `json:"maxInflightPerEndpoint"`
	RetryRefused           *bool       `json:"retryRefused"`
}

type rawService struct {
	Name           *string     `json:"name"`
	VIP            *string     `json:"vip"`
	Port           *int        `json:"port"`
	Protocol       *string     `json:"protocol"`
	Backends       []string    `json:"backends"`
	FailureAccrual *rawAccrual `json:"failureAccrual"`
	// Circuit breaker: live flows allowed; unset inherits the default, 0
	// means no limit.
	MaxInflight            *int64 `json:"maxInflight"`
	MaxInflightPerEndpoint *int64 `json:"maxInflightPerEndpoint"`
	// RetryRefused: a refused new connection gets one more try on another
	// backend (its client sees a delay, not the refusal).
	RetryRefused *bool `json:"retryRefused"`
	// SessionAffinity: a client's new connections go to the backend of
	// its last one while that was less than this long ago (Kubernetes'
	// sessionAffinity ClientIP); unset or "0s": none.
	SessionAffinity *duration `json:"sessionAffinity"`
}

// duration is a Go duration string ("10s", "5m"). Its own type only so the
// shape check can say "want a duration" rather than "want a string" when
// someone writes minPenalty: 10.
type duration string

var durationType = reflect.TypeFor[duration]()

// decode turns YAML into a rawConfig. The YAML goes to JSON first
// (sigs.k8s.io/yaml, strict: duplicate keys and syntax errors are caught
// there), then the JSON tree is checked against the raw types by checkShape,
// which reports every mismatch with its full path ("services[1].port") and
// value. encoding/json alone would say "unknown field \"foo\"" or "cannot
// unmarshal string into ... services.port" without saying which service.
// Only a tree that passed is decoded, strictly, into the struct.
func decode(data []byte) (*rawConfig, error) {
	if line := secondDocument(data); line > 0 {
		return nil, fmt.Errorf("line %d: a second YAML document: the config must be a single document", line)
	}
	j, err := yamlToJSON(data)
	if uv := (*json.UnsupportedValueError)(nil); errors.As(err, &uv) {
		// go-yaml reads .nan and .inf as floats; JSON cannot hold them.
		return nil, fmt.Errorf("invalid YAML: %s is not a usable number (.nan and .inf are not allowed)", uv.Str)
	}
	if err != nil {
		return nil, fmt.Errorf("invalid YAML: %w", err)
	}
	var tree any
	d := json.NewDecoder(bytes.NewReader(j))
	d.UseNumber() // integers checked as written, not as rounded float64s
	if err := d.Decode(&tree); err != nil {
		return nil, fmt.Errorf("invalid YAML: %w", err)
	}
	switch tree.(type) {
	case nil:
		return nil, errors.New("config is empty (want a mapping with at least interfaces)")
	case map[string]any:
	default:
		return nil, fmt.Errorf("top level: %s: want a mapping", show(tree))
	}
	return decodeShaped[rawConfig]("", j, tree)
}

// decodeShaped decodes JSON j, whose tree (decoded with UseNumber) is
// given, into a T once checkShape has found nothing wrong at path.
func decodeShaped[T any](path string, j []byte, tree any) (*T, error) {
	var errs errList
	checkShape(path, tree, reflect.TypeFor[T](), &errs)
	if err := errs.err(); err != nil {
		return nil, err
	}
	var raw T
	d := json.NewDecoder(bytes.NewReader(j))
	d.DisallowUnknownFields()
	if err := d.Decode(&raw); err != nil {
		// checkShape should have caught anything that gets here.
		return nil, fmt.Errorf("internal error decoding %s: %w", cmp.Or(path, "config"), err)
	}
	return &raw, nil
}

// secondDocument returns the 1-based line where a second YAML document
// starts, or 0. go-yaml reads only the first document and would silently
// drop the rest of a file someone built by concatenating with "---". A
// "---" or "..." at column 0 is always a document marker, never scalar
// content, so a line scan is exact enough.
func secondDocument(data []byte) int {
	// content: the current document has content. ended: an earlier one
	// did. start: the line of the "---" that opened the current one.
	content, ended, start := false, false, 0
	for i, line := range bytes.Split(data, []byte("\n")) {
		line = bytes.TrimRight(line, "\r")
		trimmed := bytes.TrimSpace(line)
		switch {
		case isMarker(line, "---"):
			ended, content, start = ended || content, false, i+1
			if rest := bytes.TrimSpace(line[3:]); len(rest) > 0 && rest[0] != '#' {
				if ended { // "--- {services: []}"
					return start
				}
				content = true
			}
		case isMarker(line, "..."):
			ended, content, start = ended || content, false, 0
		case len(trimmed) == 0 || trimmed[0] == '#' || (line[0] == '%' && !content):
			// blank, comment, or a directive before a document
		default:
			if ended && start > 0 {
				return start
			}
			if ended {
				return i + 1
			}
			content = true
		}
	}
	return 0
}

func isMarker(line []byte, m string) bool {
	return bytes.HasPrefix(line, []byte(m)) && (len(line) == 3 || line[3] == ' ' || line[3] == '\t')
}

// yamlToJSON converts without a target type, so sigs.k8s.io/yaml does not
// quietly turn numbers and booleans into strings (name: yes would become
// "true", minPenalty: 1.5 would become "1.5"); checkShape rejects them
// instead. The recover is there because the YAML parser is third-party code
// fed operator input: a bug in it must fail the load, not kill the agent.
func yamlToJSON(data []byte) (j []byte, err error) {
	defer func() {
		if r := recover(); r != nil {
			j, err = nil, fmt.Errorf("YAML parser failed: %v", r)
		}
	}()
	return yaml.YAMLToJSONStrict(data)
}

// checkShape walks a JSON tree (from a json.Decoder with UseNumber) against
// type t and reports, at path, values of the wrong kind and keys that t has
// no field for. Keys match json tags exactly; encoding/json's
// case-insensitive matching would otherwise let "Port" and "port" both in.
func checkShape(path string, v any, t reflect.Type, errs *errList) {
	if t.Kind() == reflect.Pointer {
		if v == nil {
			return // null is the same as absent
		}
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct:
		m, ok := v.(map[string]any)
		if !ok {
			errs.add(path, show(v), "want a mapping")
			return
		}
		fields := jsonFields(t)
		for _, k := range slices.Sorted(maps.Keys(m)) {
			p := joinPath(path, k)
			ft, ok := fields[k]
			if !ok {
				errs.add(p, "", unknownField(k, fields))
				continue
			}
			checkShape(p, m[k], ft, errs)
		}
	case reflect.Slice:
		if v == nil {
			return // unset
		}
		l, ok := v.([]any)
		if !ok {
			errs.add(path, show(v), "want a list")
			return
		}
		for i, e := range l {
			checkShape(fmt.Sprintf("%s[%d]", path, i), e, t.Elem(), errs)
		}
	case reflect.String:
		if _, ok := v.(string); ok {
			return
		}
		switch {
		case t == durationType:
			errs.add(path, show(v), `want a duration such as "500ms", "10s" or "5m"`)
		case isBool(v):
			errs.add(path, show(v), "want a string (YAML reads unquoted y/n/yes/no/on/off/true/false as booleans: quote it)")
		default:
			errs.add(path, show(v), "want a string")
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		n, ok := v.(json.Number)
		if !ok {
			errs.add(path, show(v), "want an integer")
			return
		}
		if _, err := strconv.ParseInt(n.String(), 10, t.Bits()); err != nil {
			errs.add(path, show(v), "want an integer")
		}
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		n, ok := v.(json.Number)
		if !ok {
			errs.add(path, show(v), "want an integer")
			return
		}
		if _, err := strconv.ParseUint(n.String(), 10, t.Bits()); err != nil {
			errs.add(path, show(v), fmt.Sprintf("want an integer within [0, %d]", uint64(1)<<t.Bits()-1))
		}
	case reflect.Float32, reflect.Float64:
		n, ok := v.(json.Number)
		if !ok {
			errs.add(path, show(v), "want a number")
			return
		}
		if _, err := strconv.ParseFloat(n.String(), t.Bits()); err != nil {
			errs.add(path, show(v), "want a number")
		}
	case reflect.Bool:
		if !isBool(v) {
			errs.add(path, show(v), "want true or false")
		}
	default:
		// A raw type this walker does not know: a programming error, but
		// reported rather than panicking.
		errs.add(path, show(v), fmt.Sprintf("internal error: cannot check a %s field", t))
	}
}

func isBool(v any) bool {
	_, ok := v.(bool)
	return ok
}

// jsonFields maps each json tag of struct type t to its field type.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	fields := make(map[string]reflect.Type, t.NumField())
	for i := range t.NumField() {
		f := t.Field(i)
		if name := jsonName(f); name != "" {
			fields[name] = f.Type
		}
	}
	return fields
}

func jsonName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
	if name == "-" {
		return ""
	}
	return name
}

func unknownField(k string, fields map[string]reflect.Type) string {
	names := slices.Sorted(maps.Keys(fields))
	for _, n := range names {
		if strings.EqualFold(n, k) {
			return fmt.Sprintf("unknown field (did you mean %q? keys are case-sensitive)", n)
		}
	}
	return "unknown field (want one of " + strings.Join(names, ", ") + ")"
}

func joinPath(path, k string) string {
	if path == "" {
		return k
	}
	return path + "." + k
}

// show renders a value from the JSON tree for an error message: strings
// quoted, numbers bare, long values cut.
func show(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%v", v)
	}
	const max = 60
	if r := []rune(string(b)); len(r) > max {
		return string(r[:max]) + "…"
	}
	return string(b)
}
