// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// rawAccrual is a failureAccrual block: any subset of accrual.Settings.
type rawAccrual struct {
	Mode               *string   `json:"mode"`
	MaxFailures        *int      `json:"maxFailures"`
	MinPenalty         *duration `json:"minPenalty"`
	MaxPenalty         *duration `json:"maxPenalty"`
	JitterRatio        *float64  `json:"jitterRatio"`
	ConnectTimeout     *duration `json:"connectTimeout"`
	FailureKinds       *[]string `json:"failureKinds"`
	MaxEjectionPercent *int      `json:"maxEjectionPercent"`

	Window               *duration `json:"window"`
	WindowCalls          *int      `json:"windowCalls"`
	MinCalls             *int      `json:"minCalls"`
	FailureRateThreshold *float64  `json:"failureRateThreshold"`
	// SuccessRateThreshold is Linkerd's spelling of the same rule:
	// failureRateThreshold = 1 − successRateThreshold.
	SuccessRateThreshold     *float64  `json:"successRateThreshold"`
	SlowConnectThreshold     *duration `json:"slowConnectThreshold"`
	SlowConnectRateThreshold *float64  `json:"slowConnectRateThreshold"`
	Outliers                 *bool     `json:"outliers"`
	OutlierStdevFactor       *float64  `json:"outlierStdevFactor"`
	OutlierMinHosts          *int      `json:"outlierMinHosts"`
	OutlierMinCalls          *int      `json:"outlierMinCalls"`
}

// resolve overlays the fields r sets onto base, field by field, and
// validates the result. base must be valid: then any error is r's doing and
// is reported at a path inside r (path is r's own, e.g.
// "services[0].failureAccrual"). A nil r yields base. ok is false when
// anything was reported.
func (r *rawAccrual) resolve(path string, base accrual.Settings, errs *errList) (s accrual.Settings, ok bool) {
	s = base
	if r == nil {
		return s, true
	}
	before := errs.count()
	if r.Mode != nil {
		s.Mode = accrual.Mode(*r.Mode) // Validate rejects unknown modes
	}
	if r.MaxFailures != nil {
		s.MaxFailures = *r.MaxFailures
	}
	setDuration(&s.MinPenalty, r.MinPenalty, path+".minPenalty", errs)
	setDuration(&s.MaxPenalty, r.MaxPenalty, path+".maxPenalty", errs)
	if r.JitterRatio != nil {
		s.JitterRatio = *r.JitterRatio
	}
	setDuration(&s.ConnectTimeout, r.ConnectTimeout, path+".connectTimeout", errs)
	if r.FailureKinds != nil {
		s.FailureKinds = parseKinds(*r.FailureKinds, path+".failureKinds", errs)
	}
	if r.MaxEjectionPercent != nil {
		s.MaxEjectionPercent = *r.MaxEjectionPercent
	}
	setDuration(&s.Window, r.Window, path+".window", errs)
	set(&s.WindowCalls, r.WindowCalls)
	set(&s.MinCalls, r.MinCalls)
	set(&s.FailureRateThreshold, r.FailureRateThreshold)
	if r.SuccessRateThreshold != nil {
		switch v := *r.SuccessRateThreshold; {
		case r.FailureRateThreshold != nil:
			errs.add(path+".successRateThreshold", showRaw(reflect.ValueOf(v)), "set either failureRateThreshold or successRateThreshold (1 − the other), not both")
		default:
			rate, ok := accrual.FailureRateFor(v)
			if !ok {
				errs.add(path+".successRateThreshold", showRaw(reflect.ValueOf(v)), "must be within (0, 1), e.g. 0.8")
				break
			}
			s.FailureRateThreshold = rate
		}
	}
	setDuration(&s.SlowConnectThreshold, r.SlowConnectThreshold, path+".slowConnectThreshold", errs)
	set(&s.SlowConnectRateThreshold, r.SlowConnectRateThreshold)
	set(&s.Outliers, r.Outliers)
	set(&s.OutlierStdevFactor, r.OutlierStdevFactor)
	set(&s.OutlierMinHosts, r.OutlierMinHosts)
	set(&s.OutlierMinCalls, r.OutlierMinCalls)
	if errs.count() > before {
		return s, false
	}
	if err := s.Validate(); err != nil {
		r.report(path, err, errs)
		return s, false
	}
	return s, true
}

// set overlays a field the block sets.
func set[T any](dst *T, src *T) {
	if src != nil {
		*dst = *src
	}
}

func setDuration(dst *time.Duration, src *duration, path string, errs *errList) {
	if src == nil {
		return
	}
	d, err := time.ParseDuration(string(*src))
	if err != nil {
		errs.add(path, strconv.Quote(string(*src)), `invalid duration (want e.g. "500ms", "10s", "5m")`)
		return
	}
	*dst = d // sign and range are Validate's business
}

// parseKinds rejects unknown and repeated kinds; an empty list is left to
// Validate, which allows it only when mode is none.
func parseKinds(names []string, path string, errs *errList) accrual.Kinds {
	var set accrual.Kinds
	first := map[accrual.Kind]int{}
	for i, name := range names {
		p := path + "[" + strconv.Itoa(i) + "]"
		k, err := accrual.ParseKind(name)
		if err != nil {
			errs.add(p, strconv.Quote(name), "unknown failure kind (want refused, timeout, reset or reset-after-data)")
			continue
		}
		if j, dup := first[k]; dup {
			errs.add(p, strconv.Quote(name), "duplicate of failureKinds["+strconv.Itoa(j)+"]")
			continue
		}
		first[k] = i
		set |= accrual.KindsOf(k)
	}
	return set
}

// report places a Validate error at the field of r it is due to, showing
// the value as r wrote it.
func (r *rawAccrual) report(path string, err error, errs *errList) {
	var fe *accrual.FieldError
	if !errors.As(err, &fe) {
		errs.add(path, "", err.Error())
		return
	}
	if v, ok := r.lookup(fe.Field); ok {
		errs.add(path+"."+fe.Field, v, fe.Msg)
		return
	}
	if p, ok := accrual.Partner(fe.Field); ok {
		if v, ok := r.lookup(p); ok {
			errs.add(path+"."+p, v, "conflicts with inherited "+fe.Error())
			return
		}
	}
	// Validate found a rule this package does not know of.
	errs.add(path, "", "inherited "+fe.Error())
}

// lookup returns the value r sets for the config field name, as written.
// It goes by json tag, so fields added to rawAccrual need no change here.
func (r *rawAccrual) lookup(name string) (string, bool) {
	v := reflect.ValueOf(r).Elem()
	for i := range v.NumField() {
		if jsonName(v.Type().Field(i)) != name {
			continue
		}
		f := v.Field(i)
		if f.IsNil() {
			return "", false
		}
		return showRaw(f.Elem()), true
	}
	return "", false
}

// showRaw renders a raw field value the way show renders JSON: strings
// quoted, numbers bare.
func showRaw(v reflect.Value) string {
	switch v.Kind() {
	case reflect.String:
		return strconv.Quote(v.String())
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return strconv.FormatInt(v.Int(), 10)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return strconv.FormatUint(v.Uint(), 10)
	case reflect.Float32, reflect.Float64:
		return strconv.FormatFloat(v.Float(), 'g', -1, 64)
	case reflect.Slice:
		parts := make([]string, v.Len())
		for i := range parts {
			parts[i] = showRaw(v.Index(i))
		}
		return "[" + strings.Join(parts, ", ") + "]"
	}
	return v.String()
}
