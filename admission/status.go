package admission

import (
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Every status of a job's admission, and what each layer calls it, is in
// this file's table, statuses: a reader looking for what a status means,
// or where one is decided, starts here.
//
// A job's admission is decided in Redis by throttle's admit.lua, which
// replies one of the statuses its lua/status.lua names (the table's first
// column); throttle decodes it into a throttle.AdmitStatus and its
// Admission's InLine and Lease (throttle/replies.go, admitStatuses: the one
// place a script's status becomes one). For each, the table then says what
// a gate makes of it (an Outcome: the job runs or parks; none: Admit fails
// with a *throttle.DelayError), and what the worker calls it: a label, the
// value of jobthrottle_decisions_total's outcome label (the status page
// counts the same; a job that parks is StatusParked in the worker's
// explain), and the reason its log entry gives (Decision.Label and
// Decision.Reason; Wait.Label and Wait.Reason for a job that ran).
//
// Three labels name no status: they say how a job fared without one, when
// its wait ended otherwise (the worker decides them): LabelDeferred also
// for a job put back for a drain, or past its wait without a booking
// (a limiter that cannot book), LabelRefunded, LabelError.

// The labels of a job's decision in the worker's metrics and logs: the
// values of jobthrottle_decisions_total's outcome label, and the keys of
// the status page's counts (worker.RuleActivity.Decisions).
const (
	// LabelAdmitted: run at once (a wait under WaitThreshold), on a new
	// turn.
	LabelAdmitted = "admitted"
	// LabelWaited: run on a new turn after waiting for it in place
	// (WaitThreshold or more).
	LabelWaited = "waited"
	// LabelRedeemed: run on a turn booked before it arrived: when it
	// parked, or by its producer (ReceiptHeader).
	LabelRedeemed = "redeemed"
	// LabelParked: parked until its turn, booked under its ID, or in its
	// subject's line, or queued for a place (a *ThrottledError for
	// Decision.At).
	LabelParked = "parked"
	// LabelDeferred: deferred with a *ThrottledError for an estimate: no
	// turn within its wait and nothing booked (throttle.Denied, or a
	// limiter that cannot book), or put back by a drain.
	LabelDeferred = "deferred"
	// LabelRefunded: the job's context ended while it waited; its new
	// turn's permits were refunded.
	LabelRefunded = "refunded"
	// LabelError: no subject or cost (archived), or Redis failed
	// (deferred).
	LabelError = "error"
)

// WaitThreshold is the wait below which a job run on a new turn is
// LabelAdmitted rather than LabelWaited: about a Redis round trip.
const WaitThreshold = 5 * time.Millisecond

// statusRow is one row of statuses: a status in each layer.
type statusRow struct {
	script  string               // admit.lua's name for it (lua/status.lua)
	status  throttle.AdmitStatus // throttle's, with the Admission's InLine or Lease
	inLine  bool                 // Admission.InLine: in the subject's line
	queued  bool                 // Booked with a Lease: queued for a place
	waited  bool                 // Granted after WaitThreshold or more in place
	outcome Outcome              // the gate's; 0: Admit fails (*throttle.DelayError)
	label   string               // the worker's metric label
	reason  string               // the worker's log entry's reason; "" for none
}

// statuses is the table: every status of an admission, from Redis up.
var statuses = [...]statusRow{
	{script: "DENIED", status: throttle.Denied, label: LabelDeferred,
		reason: "no turn within its wait, and no ID to book one under"},
	{script: "GRANTED", status: throttle.Granted, outcome: Run, label: LabelAdmitted},
	{script: "GRANTED", status: throttle.Granted, waited: true, outcome: Run, label: LabelWaited,
		reason: "its turn came within the rule's max_wait"},
	{script: "REDEEMED", status: throttle.Redeemed, outcome: Run, label: LabelRedeemed,
		reason: "ran on the turn booked for it"},
	{script: "BOOKED", status: throttle.Booked, outcome: Park, label: LabelParked,
		reason: "a new turn, booked under its ID"},
	{script: "HELD", status: throttle.Held, outcome: Park, label: LabelParked,
		reason: "back early for its booked turn, which it keeps"},
	{script: "QUEUED", status: throttle.Booked, queued: true, outcome: Park, label: LabelParked,
		reason: "queued for a place of the concurrency rule"},
	{script: "IN_LINE", status: throttle.Booked, inLine: true, outcome: Park, label: LabelParked,
		reason: "in its subject's line, no turn booked yet"},
}

// rowOf returns the row of an admission with status, in the subject's
// line or queued for a place, that waited (as long as) waited in place.
func rowOf(status throttle.AdmitStatus, inLine, queued bool, waited time.Duration) statusRow {
	long := status == throttle.Granted && waited >= WaitThreshold
	for _, r := range statuses {
		if r.status == status && r.inLine == inLine && r.queued == queued && r.waited == long {
			return r
		}
	}
	return statusRow{status: status, label: LabelError} // not a status admit.lua sends
}

// row returns the decision's row of statuses.
func (d Decision) row() statusRow {
	queued := d.Status == throttle.Booked && !d.InLine && d.Lease > 0
	return rowOf(d.Status, d.InLine, queued, d.Waited)
}

// Label returns what the worker's metrics call the decision (see
// statuses): LabelAdmitted, LabelWaited or LabelRedeemed for Run,
// LabelParked for Park.
func (d Decision) Label() string { return d.row().label }

// Reason returns why the decision is what it is, as the worker's log entry
// gives it: "ran on the turn booked for it", "in its subject's line, no
// turn booked yet"…; empty for a job run at once on a new turn.
func (d Decision) Reason() string { return d.row().reason }

// row returns the row of statuses of the admission w tells of.
func (w Wait) row() statusRow {
	if w.Redeemed {
		return rowOf(throttle.Redeemed, false, false, w.Duration)
	}
	return rowOf(throttle.Granted, false, false, w.Duration)
}

// Label returns what the worker's metrics call the admission w tells of:
// LabelRedeemed, or LabelAdmitted or LabelWaited by its Duration
// (WaitThreshold).
func (w Wait) Label() string { return w.row().label }

// Reason returns why the job ran when it did, as the worker's log entry
// gives it; empty for a job run at once on a new turn.
func (w Wait) Reason() string { return w.row().reason }
