package reliability

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// envChild names the role a re-executed test binary plays (see runChild).
const envChild = "JT_RELIABILITY_CHILD"

// redisLog records what go-redis's own logger prints (dial failures and
// the like) instead of letting it flood the test output; the secrets test
// reads it, and failing tests can print its tail.
var redisLog = &recordingLogger{}

func TestMain(m *testing.M) {
	flag.Parse()
	redis.SetLogger(redisLog)
	raiseParallel()
	code := m.Run()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// reliabilityParallel is how many of this package's parallel tests run at
// once unless -test.parallel says otherwise: they mostly wait (for
// processes to start, turns of a few per second, failovers, outages), so
// go test's default, GOMAXPROCS (2 on CI), would leave the machine idle.
// The tests that load the machine or check for leaked goroutines are
// sequential, and run before any parallel one.
const reliabilityParallel = 8

// raiseParallel sets -test.parallel to reliabilityParallel if it was not
// given and is lower.
func raiseParallel() {
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if p := flag.Lookup("test.parallel"); p != nil && !given {
		if n, err := strconv.Atoi(p.Value.String()); err == nil && n < reliabilityParallel {
			_ = p.Value.Set(strconv.Itoa(reliabilityParallel))
		}
	}
}

// Binaries built by buildBinary, once per test process.
var (
	binMu   sync.Mutex
	binDir  string
	binPath = map[string]string{}
)

// buildBinary builds the main package pkg (a path from the repository
// root, such as "cmd/worker") with go build, once per test run, and
// returns the executable's path.
func buildBinary(t testing.TB, pkg string) string {
	t.Helper()
	binMu.Lock()
	defer binMu.Unlock()
	if p, ok := binPath[pkg]; ok {
		return p
	}
	if binDir == "" {
		d, err := os.MkdirTemp("", "jobthrottle-reliability-bin-")
		if err != nil {
			t.Fatal(err)
		}
		binDir = d
	}
	out := filepath.Join(binDir, filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", out, "../"+pkg)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ../%s: %v\n%s", pkg, err, b)
	}
	binPath[pkg] = out
	return out
}

// recordingLogger is a go-redis logger that keeps every line in memory.
type recordingLogger struct {
	mu    sync.Mutex
	lines []string
}

func (l *recordingLogger) Printf(_ context.Context, format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, v...))
}

func (l *recordingLogger) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.lines)
}

// logRecorder is a slog.Handler that keeps every record as one text line
// (message and attributes), for tests that check what a limiter logs.
type logRecorder struct {
	mu    *sync.Mutex
	lines *[]string
	attrs []slog.Attr
}

func newLogRecorder() *logRecorder { return &logRecorder{mu: new(sync.Mutex), lines: new([]string)} }

func (h *logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	var b bytes.Buffer
	th := slog.NewTextHandler(&b, &slog.HandlerOptions{Level: slog.LevelDebug})
	_ = th.WithAttrs(h.attrs).Handle(context.Background(), r)
	h.mu.Lock()
	defer h.mu.Unlock()
	*h.lines = append(*h.lines, strings.TrimSpace(b.String()))
	return nil
}

func (h *logRecorder) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	c.attrs = append(slices.Clone(h.attrs), as...)
	return &c
}

func (h *logRecorder) WithGroup(string) slog.Handler { return h }

func (h *logRecorder) Lines() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(*h.lines)
}

// count returns how many recorded lines contain s.
func (h *logRecorder) count(s string) int {
	n := 0
	for _, l := range h.Lines() {
		if strings.Contains(l, s) {
			n++
		}
	}
	return n
}

// checkNoLeaks records the goroutines running now and, when the test ends,
// fails it if goroutines of the library or of go-redis started since are
// still running after a grace period. (go.uber.org/goleak does the same with
// more options; this keeps the module free of a test-only dependency.)
// Register it before anything whose t.Cleanup closes clients, so that it
// runs after them.
func checkNoLeaks(t testing.TB) {
	t.Helper()
	before := map[string]bool{}
	for _, g := range goroutines() {
		before[goroutineID(g)] = true
	}
	t.Cleanup(func() {
		var leaked []string
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			leaked = leaked[:0]
			for _, g := range goroutines() {
				if before[goroutineID(g)] {
					continue
				}
				if strings.Contains(g, "jobthrottle/jobthrottle/throttle") || strings.Contains(g, "redis/go-redis") {
					leaked = append(leaked, g)
				}
			}
			if len(leaked) == 0 || time.Now().After(deadline) {
				break
			}
		}
		if len(leaked) > 0 {
			t.Errorf("%d goroutines of throttle or go-redis still running 5s after the test:\n%s",
				len(leaked), strings.Join(leaked[:min(len(leaked), 5)], "\n\n"))
		}
	})
}

// goroutines returns the stack of every goroutine.
func goroutines() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Split(string(buf[:n]), "\n\n")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// goroutineID returns "goroutine 123" from a stack's first line.
func goroutineID(stack string) string {
	f := strings.Fields(stack)
	if len(f) < 2 {
		return stack
	}
	return f[0] + " " + f[1]
}

// assertKeyHygiene checks jobthrottle's key contract under prefix: every
// key has a TTL (PTTL > 0, never a key without expiry), and once the longest
// TTL has passed the prefix is empty. On miniredis (mini non-nil) time is
// fast-forwarded; on a real server the test sleeps when the longest TTL is
// at most maxHygieneSleep, and otherwise only the TTLs are checked (and the
// skipped part logged). It returns the longest TTL seen. On a cluster
// client every master is scanned.
func assertKeyHygiene(t testing.TB, rdb redis.UniversalClient, prefix string, mini ...*miniredis.Miniredis) time.Duration {
	t.Helper()
	ctx := context.Background()
	keys := scanKeys(t, rdb, prefix)
	var longest time.Duration
	for _, k := range keys {
		ttl, err := rdb.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatalf("PTTL %q: %v", k, err)
		}
		switch {
		case ttl == -2*time.Nanosecond || ttl == -2*time.Millisecond:
			continue // expired between SCAN and PTTL
		case ttl == 0:
			continue // expires within the millisecond (Redis rounds PTTL down)
		case ttl < 0:
			t.Errorf("key %q has no TTL (PTTL = %v): every jobthrottle key must expire", k, ttl)
		}
		longest = max(longest, ttl)
	}
	if len(keys) == 0 || t.Failed() {
		return longest
	}
	switch {
	case len(mini) > 0 && mini[0] != nil:
		mini[0].FastForward(longest + time.Millisecond)
	case longest <= maxHygieneSleep:
		time.Sleep(longest + 50*time.Millisecond)
	default:
		t.Logf("key hygiene: longest TTL %v is too long to wait for; checked only that every key has one", longest)
		return longest
	}
	if left := scanKeys(t, rdb, prefix); len(left) > 0 {
		t.Errorf("after the longest TTL (%v), %d keys are still under %q: %v", longest, len(left), prefix, left[:min(len(left), 10)])
	}
	return longest
}

// maxHygieneSleep is the longest real wait assertKeyHygiene accepts.
const maxHygieneSleep = 5 * time.Second

// scanKeys returns every key that starts with prefix.
func scanKeys(t testing.TB, rdb redis.UniversalClient, prefix string) []string {
	t.Helper()
	ctx := context.Background()
	var mu sync.Mutex
	var keys []string
	scan := func(ctx context.Context, c *redis.Client) error {
		it := c.Scan(ctx, 0, escapeGlob(prefix)+"*", 1000).Iterator()
		for it.Next(ctx) {
			mu.Lock()
			keys = append(keys, it.Val())
			mu.Unlock()
		}
		return it.Err()
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, scan)
	case *redis.Client:
		err = scan(ctx, c)
	default:
		t.Fatalf("scanKeys: unsupported client %T", rdb)
	}
	if err != nil {
		t.Fatalf("SCAN %q: %v", prefix, err)
	}
	slices.Sort(keys)
	return slices.Compact(keys)
}

// escapeGlob escapes the glob characters of a SCAN MATCH pattern.
func escapeGlob(s string) string {
	var b strings.Builder
	for _, c := range s {
		if strings.ContainsRune(`*?[]\^`, c) {
			b.WriteByte('\\')
		}
		b.WriteRune(c)
	}
	return b.String()
}

// serverPID returns the process id of the redis-server rdb talks to.
func serverPID(t testing.TB, rdb *redis.Client) int {
	t.Helper()
	info, err := rdb.Info(context.Background(), "server").Result()
	if err != nil {
		t.Fatalf("INFO server: %v", err)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			pid, err := strconv.Atoi(v)
			if err != nil {
				t.Fatalf("INFO server process_id %q: %v", v, err)
			}
			return pid
		}
	}
	t.Fatalf("INFO server has no process_id:\n%s", info)
	return 0
}

// child is the role of this process if it was started by runChild, or "".
func child() string { return os.Getenv(envChild) }

// childCommand returns a command that re-runs this test binary, running
// only the test named test, with role in the environment (see child) and
// env added. Its output goes to the returned buffer.
func childCommand(t testing.TB, ctx context.Context, test, role string, env ...string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("os.Executable: %v", err)
	}
	cmd := exec.CommandContext(ctx, exe, "-test.run=^"+test+"$", "-test.count=1", "-test.v")
	cmd.Env = append(append(os.Environ(), envChild+"="+role), env...)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	return cmd, out
}

// syncBuffer is a bytes.Buffer safe for concurrent writes and reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// percentile returns the p-th percentile (0..100) of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted)-1) * p / 100)
	return sorted[i]
}

// slogLogger returns a logger that writes to h.
func slogLogger(h slog.Handler) *slog.Logger { return slog.New(h) }
