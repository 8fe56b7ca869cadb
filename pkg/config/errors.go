// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"fmt"
)

// FieldError is one problem in a config file. Parse returns them joined
// (errors.Join), so errors.As finds the first and the text lists all, one
// per line.
type FieldError struct {
	// Path is where in the file: "interfaces[2]", "services[1].backends[0]",
	// "defaults.failureAccrual.jitterRatio".
	Path string
	// Value is the offending value as written, strings quoted ("\"tcpp\"",
	// "1.5", "[]"), or empty when the field is missing.
	Value string
	Msg   string
}

// Error reads "path: value: msg", or "path: msg" when there is no value.
func (e *FieldError) Error() string {
	if e.Value == "" {
		return e.Path + ": " + e.Msg
	}
	return e.Path + ": " + e.Value + ": " + e.Msg
}

// maxErrors bounds the report: a file with 60000 bad backends should not
// produce 60000 lines.
const maxErrors = 20

// errList collects every problem found so one run reports them all rather
// than one per edit-and-retry.
type errList struct {
	errs    []error
	dropped int
}

func (l *errList) add(path, value, msg string) {
	if len(l.errs) >= maxErrors {
		l.dropped++
		return
	}
	l.errs = append(l.errs, &FieldError{Path: path, Value: value, Msg: msg})
}

func (l *errList) count() int { return len(l.errs) + l.dropped }

func (l *errList) err() error {
	if l.count() == 0 {
		return nil
	}
	errs := l.errs
	if l.dropped > 0 {
		errs = append(errs[:len(errs):len(errs)], fmt.Errorf("... and %d more errors", l.dropped))
	}
	return errors.Join(errs...)
}
