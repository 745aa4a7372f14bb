package handler_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// The http handler sends the task's ID in the Idempotency-Key header,
// or in the header the file names, or in none; a retried task sends the
// same key as its first try, and another task another key.
func TestHTTPHandlerIdempotencyKey(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	// seen is what one task's requests carried, try by try.
	type seen struct{ idem, requestID []string }
	var mu sync.Mutex
	byPath := map[string]*seen{}
	tries := map[string]int{}
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		s := byPath[r.URL.Path]
		if s == nil {
			s = &seen{}
			byPath[r.URL.Path] = s
		}
		s.idem = append(s.idem, r.Header.Values("Idempotency-Key")...)
		s.requestID = append(s.requestID, r.Header.Values("X-Request-Id")...)
		if tries[r.URL.Path]++; tries[r.URL.Path] == 1 {
			http.Error(w, "try again", http.StatusInternalServerError) // asynq retries
			return
		}
		fmt.Fprint(w, "ok")
	}))
	t.Cleanup(api.Close)
	rules := fmt.Sprintf(`
prefix: %q
rules:
  - {name: r, tasks: ["unrelated"], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}
handlers:
  - {task: "key:default", http: {url: "%[2]s/default/{n}"}}
  - {task: "key:custom", http: {url: "%[2]s/custom/{n}", idempotency_header: x-request-id}}
  - {task: "key:off", http: {url: "%[2]s/off/{n}", idempotency_header: ""}}
`, redistest.Prefix(t), api.URL)
	fleet(t, rdb, rules, 1, 4, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	ids := map[string]string{} // path -> task ID
	var all []string
	for _, kind := range []string{"default", "custom", "off"} {
		for n := range 2 {
			info, err := client.Enqueue(asynq.NewTask("key:"+kind, fmt.Appendf(nil, `{"n": %d}`, n)), asynq.MaxRetry(3), asynq.Retention(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			ids[fmt.Sprintf("/%s/%d", kind, n)] = info.ID
			all = append(all, info.ID)
		}
	}
	settle(t, asynq.NewInspectorFromRedisClient(rdb), all, 30*time.Second)
	mu.Lock()
	defer mu.Unlock()
	for path, id := range ids {
		s := byPath[path]
		if s == nil || tries[path] != 2 {
			t.Errorf("%s: %d requests; want 2 (a failed try, then the retry)", path, tries[path])
			continue
		}
		var want seen
		switch path[:len(path)-2] {
		case "/default":
			want.idem = []string{id, id}
		case "/custom":
			want.requestID = []string{id, id}
		}
		if !slices.Equal(s.idem, want.idem) || !slices.Equal(s.requestID, want.requestID) {
			t.Errorf("%s: Idempotency-Key %q, X-Request-Id %q; want %q and %q (the task ID %s on each try)", path, s.idem, s.requestID, want.idem, want.requestID, id)
		}
	}
}
