package throttle

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// algorithm is everything that differs from one algorithm to another. Each
// is registered by its own file (concurrency.go, fixedwindow.go, slidinglog.go,
// slidingwindow.go, tokenbucket.go, gcra.go), beside its Lua file; the rest
// of the package looks them up, so a new algorithm is a constant, one Go
// file and its Lua files.
type algorithm struct {
	rank int // the order of algorithm lists, in messages and docs
	// files are the Lua files that define check_<name> and commit_<name>,
	// in order; use_<name>.lua hands them to the operations' scripts (scripts.go).
	files []string
	// bucket: a burst applies (Limit.Burst), Wait reserves a future slot,
	// and count and period reach the script in lowest terms (bucket.lua's
	// exact arithmetic). Otherwise the limit admits Count at most at once.
	bucket bool
	// holders: the rule counts holders of a place (Concurrency), not
	// permits; a request's n does not charge it.
	holders bool
	// validate checks what only this algorithm requires of a rule, after
	// the checks every limit has (nil: nothing more).
	validate func(Rule) error
	// extra is the script's fourth value for a rule (nil: Limit.Burst).
	extra func(Rule) int64
}

// registry holds the registered algorithms, by name.
var registry = map[Algorithm]*algorithm{}

// register adds an algorithm. Each algorithm's file calls it in a
// package-level var declaration (var _ = register(...)), which Go runs
// before any init function, whatever the files' order: scripts.go's init
// then finds every algorithm registered.
func register(a Algorithm, spec *algorithm) bool {
	if _, dup := registry[a]; dup {
		panic(fmt.Sprintf("throttle: algorithm %q registered twice", a))
	}
	registry[a] = spec
	return true
}

// spec returns a's description, or nil for an unknown algorithm.
func (a Algorithm) spec() *algorithm { return registry[a] }

// registered returns the registered algorithms in order.
func registered() []Algorithm {
	as := make([]Algorithm, 0, len(registry))
	for a := range registry {
		as = append(as, a)
	}
	slices.SortFunc(as, func(x, y Algorithm) int { return cmp.Compare(registry[x].rank, registry[y].rank) })
	return as
}

// algorithmNames returns every algorithm's name, in order.
func algorithmNames() []string {
	var names []string
	for _, a := range registered() {
		names = append(names, string(a))
	}
	return names
}

// algorithmList names every algorithm for messages: "fixed_window,
// sliding_log, …, concurrency or calendar".
func algorithmList() string {
	names := algorithmNames()
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// bucket reports whether a can reserve future permits with a burst.
func (a Algorithm) bucket() bool {
	s := a.spec()
	return s != nil && s.bucket
}

// Algorithms returns every algorithm, in the order messages and docs list
// them: fixed_window, sliding_log, sliding_window, token_bucket, gcra,
// concurrency, calendar. Rules files and command lines list these names rather than
// their own copy.
func Algorithms() []Algorithm { return registered() }

// Bucket reports whether a is a bucket algorithm (TokenBucket, GCRA): a
// rule's Limit.Burst applies (its capacity), a turn can be booked for any
// moment, so that a share limit can be kept beside it, and the two keep
// one state in Redis, so a rule may change from one to the other while its
// keys live.
func (a Algorithm) Bucket() bool { return a.bucket() }

// CheckShare checks l as the limit of each share of a subject's line
// kept under rules (AdmitRequest.ShareLimit), and returns it with a zero
// Burst made Count. rules, workers and Admit check a share limit with it.
// An error is a *ConfigError: of Rule "share_limit" for a field of l
// (count, period, burst: a share limit is a GCRA limit), or of the rule of
// rules that cannot keep shares, Field "algorithm": every rule must be a
// Bucket algorithm, which can book a share's turn for any moment.
func (l Limit) CheckShare(rules ...Rule) (Limit, error) {
	if l.Burst == 0 {
		l.Burst = l.Count
	}
	if err := (Rule{Name: "share_limit", Algorithm: GCRA, Limit: l}).Validate(); err != nil {
		return l, err
	}
	for _, r := range rules {
		if !r.Algorithm.bucket() {
			return l, &ConfigError{Rule: r.Name, Field: "algorithm", Reason: fmt.Sprintf(
				"needs limits of gcra or token_bucket, which can book a turn for any moment; %q is %s", r.Name, r.Algorithm)}
		}
	}
	return l, nil
}
