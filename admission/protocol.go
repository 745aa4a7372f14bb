package admission

// The names a producer, the queue adapter and the jobs it runs must agree
// on. They live here, in the package every side imports, so that a
// producer (package enqueue) and a handler (package handler) need not
// import the asynq adapter (package worker).
const (
	// ReceiptHeader is the task header that carries a receipt from
	// throttle.Limiter.PrepayN: a task paced at enqueue time under the
	// same limiter and subject. The worker middleware passes it to the
	// gate as Request.Receipt, which redeems it instead of charging the
	// rule again; a receipt that does not redeem (unknown, expired, used,
	// or for other rules) is ignored and the task is charged as usual.
	ReceiptHeader = "jobthrottle-receipt"
	// EnqueuedHeader is the task header in which jobthrottle's producers
	// (package enqueue) record when a task was enqueued, in Unix
	// microseconds. The worker middleware reads it for
	// jobthrottle_start_delay_seconds, the time from enqueue to start.
	EnqueuedHeader = "jobthrottle-enqueued"
	// WakeupsKey is the key, in the queue's Redis, of the ledger of parked
	// tasks to wake at their turns (Wakeups): of its first shard, from
	// which the other shards' keys derive (NewShardedWakeups). Every
	// worker of a fleet and every producer that paces tasks uses it,
	// whatever their rules' prefix.
	WakeupsKey = "jobthrottle:{wakeups}"
)
