package admission_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Three jobs of one account arrive together under a limit of one per
// minute, with turns booked at most 90s ahead: the first runs, the second
// parks on a turn booked a minute ahead, the third waits in the account's
// line (its turn, two minutes ahead, is past the horizon), and a parked job
// that comes back early for its turn is told to come back again, its turn
// kept. Serving the line now books nothing: it is due again once the
// third job's turn is half a horizon away.
func ExampleGate() {
	m, err := miniredis.Run() // an in-process Redis; pass your own client
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	var lim *throttle.Limiter
	lim, err = throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Minute, Burst: 1}.WithBurst(1)})
	if err != nil {
		panic(err)
	}
	gate, err := admission.New(lim, admission.Options{Settings: admission.Settings{Horizon: 90 * time.Second}})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for _, id := range []string{"job-1", "job-2", "job-3", "job-2"} {
		d, err := gate.Admit(ctx, admission.Request{Subject: "acct-42", Caller: throttle.Caller{ID: id}})
		if err != nil {
			panic(err)
		}
		if d.InLine {
			fmt.Printf("%s: %v, in line\n", id, d.Outcome)
			continue
		}
		fmt.Printf("%s: %v (%v), turn in %v\n", id, d.Outcome, d.Status, time.Until(d.At).Round(time.Minute))
	}
	s, err := gate.Serve(ctx, "acct-42")
	if err != nil {
		panic(err)
	}
	fmt.Printf("served: %d booked, serve again in %v\n", len(s.Handed), time.Until(s.Next).Round(15*time.Second))
	// Output:
	// job-1: run (granted), turn in 0s
	// job-2: park (booked), turn in 1m0s
	// job-3: park, in line
	// job-2: park (held), turn in 1m0s
	// served: 0 booked, serve again in 1m15s
}

// Two jobs of one account under 5 per second, with parking: the first
// runs, the second parks on its turn 200ms ahead and the gate records its
// wake-up in the ledger; Run takes it shortly before its turn and hands it
// to the queue's wake function, which here only prints it (a queue would
// move the job back to pending). The queue supplies that function and
// nothing else: Run serves lines and sweeps places itself.
func ExampleParking() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5).WithBurst(1)})
	if err != nil {
		panic(err)
	}
	ledger, err := admission.NewWakeups(rdb, admission.WakeupsKey)
	if err != nil {
		panic(err)
	}
	parking, err := admission.NewParking(ledger, admission.ParkingOptions{})
	if err != nil {
		panic(err)
	}
	gate, err := admission.New(lim, admission.Options{Parking: parking, Name: "api", Settings: admission.Settings{WaitSlots: 1, MaxWait: time.Millisecond}})
	if err != nil {
		panic(err)
	}
	parking.Serve(map[string]*admission.Gate{"api": gate})
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	for _, id := range []string{"job-1", "job-2"} {
		job := admission.JobEntry{Queue: "default", ID: id}
		d, err := gate.Admit(ctx, admission.Request{Subject: "acct-42", Caller: throttle.Caller{ID: id, Waiter: job.Member()}})
		if err != nil {
			panic(err)
		}
		fmt.Printf("%s: %v, woken by the ledger: %v\n", id, d.Outcome, d.Woken)
	}
	_ = parking.Run(ctx, admission.RunOptions{}, func(_ context.Context, job admission.JobEntry) error {
		fmt.Printf("wake %s in queue %s\n", job.ID, job.Queue)
		stop() // one job to wake: done
		return nil
	})
	// Output:
	// job-1: run, woken by the ledger: false
	// job-2: park, woken by the ledger: true
	// wake job-2 in queue default
}
