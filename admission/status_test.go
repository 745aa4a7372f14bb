package admission

import (
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestStatusLabels reads the table of statuses as the worker does: each
// decision's label and reason, and the outcome Admit gives it.
func TestStatusLabels(t *testing.T) {
	a := func(s throttle.AdmitStatus) throttle.Admission { return throttle.Admission{Status: s} }
	for _, c := range []struct {
		name    string
		d       Decision
		outcome Outcome
		label   string
		reason  string
	}{
		{"granted at once", Decision{Admission: a(throttle.Granted), Waited: WaitThreshold - 1}, Run, LabelAdmitted, ""},
		{"granted after a wait", Decision{Admission: a(throttle.Granted), Waited: WaitThreshold}, Run, LabelWaited, "its turn came within the rule's max_wait"},
		{"redeemed", Decision{Admission: a(throttle.Redeemed), Waited: time.Second}, Run, LabelRedeemed, "ran on the turn booked for it"},
		{"booked", Decision{Admission: a(throttle.Booked)}, Park, LabelParked, "a new turn, booked under its ID"},
		{"held", Decision{Admission: a(throttle.Held)}, Park, LabelParked, "back early for its booked turn, which it keeps"},
		{"queued", Decision{Admission: throttle.Admission{Status: throttle.Booked, Lease: time.Second}}, Park, LabelParked, "queued for a place of the concurrency rule"},
		{"in line", Decision{Admission: throttle.Admission{Status: throttle.Booked, InLine: true}}, Park, LabelParked, "in its subject's line, no turn booked yet"},
		{"denied", Decision{Admission: a(throttle.Denied)}, 0, LabelDeferred, "no turn within its wait, and no ID to book one under"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := c.d.row().outcome; got != c.outcome {
				t.Errorf("outcome %v, want %v", got, c.outcome)
			}
			if got := c.d.Label(); got != c.label {
				t.Errorf("label %q, want %q", got, c.label)
			}
			if got := c.d.Reason(); got != c.reason {
				t.Errorf("reason %q, want %q", got, c.reason)
			}
		})
	}
	for _, c := range []struct {
		w     Wait
		label string
	}{
		{Wait{}, LabelAdmitted},
		{Wait{Duration: time.Second}, LabelWaited},
		{Wait{Redeemed: true}, LabelRedeemed},
	} {
		if got := c.w.Label(); got != c.label {
			t.Errorf("%+v: label %q, want %q", c.w, got, c.label)
		}
	}
}
