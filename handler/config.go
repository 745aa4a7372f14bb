package handler

import (
	"fmt"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/jobthrottle/jobthrottle/internal/yamlfile"
	"github.com/jobthrottle/jobthrottle/rules"
)

// Defaults and bounds of the handlers section.
const (
	// DefaultResultLimit is how much of a response body (http) or of
	// stdout (command) becomes the task's result when result_limit is not
	// set: 64 KiB. Longer output is cut there.
	DefaultResultLimit = 64 << 10
	// MaxResultLimit is the largest result_limit accepted: 1 MiB. Results
	// are stored in Redis for the task's retention.
	MaxResultLimit = 1 << 20
	// DefaultHTTPTimeout bounds one HTTP request when timeout is not set.
	DefaultHTTPTimeout = 30 * time.Second
	// DefaultCommandTimeout bounds one command run when timeout is not set.
	DefaultCommandTimeout = time.Minute
	// MaxTimeout is the longest timeout accepted.
	MaxTimeout = 24 * time.Hour
	// DefaultStopGrace is how long a command's processes have between
	// SIGTERM and SIGKILL when stop_grace is not set.
	DefaultStopGrace = 5 * time.Second
	// MaxStopGrace is the longest stop_grace accepted.
	MaxStopGrace = 10 * time.Minute
	// DefaultIdempotencyHeader is the request header that carries the
	// task's ID when idempotency_header is not set, so that an API can
	// tell a retry from a new call.
	DefaultIdempotencyHeader = "Idempotency-Key"
	// DefaultNoRetryExitCode is the exit code that archives a task at once
	// when no_retry_exit_codes is not set: 65, EX_DATAERR of sysexits.h
	// ("the input data was incorrect").
	DefaultNoRetryExitCode = 65
)

// Config is the handlers section of a rules file: what runs each task
// type.
//
//	handlers:
//	  - task: partner:sync
//	    http:
//	      method: POST
//	      url: "https://api.partner.example/v1/accounts/{account_id}/sync"
//	      headers: {Authorization: "Bearer ${PARTNER_TOKEN}"}
//	      timeout: 10s
//	  - task: report:render
//	    command:
//	      argv: ["/usr/local/bin/render", "--tenant", "{tenant}"]
//	      timeout: 2m
//
// ParseConfig and LoadConfig return only valid configs.
type Config struct {
	// File is the name the config was parsed under, used in messages.
	File string
	// Handlers in file order; none if the file has no handlers section.
	Handlers []Spec
}

// Spec says what runs one task type: exactly one of HTTP and Command is
// set.
type Spec struct {
	Task        string // the exact task type
	HTTP        *HTTPSpec
	Command     *CommandSpec
	ResultLimit int // bytes of output kept as the task's result
	Line        int // where the handler starts in the file
}

// HTTPSpec is an http handler: the task's payload is sent as the body of
// one request.
type HTTPSpec struct {
	Method string
	// URL is the template as written. Placeholders {field} take a
	// top-level payload field (a string or a number), escaped; they may
	// appear in the path and the query only.
	URL     string
	Headers []Header // in file order
	Timeout time.Duration
	// IdempotencyHeader is the header that carries the asynq task ID,
	// the same on every retry and deferral of one task; "" sends none.
	// ParseConfig sets DefaultIdempotencyHeader unless the file says
	// otherwise.
	IdempotencyHeader string
	// LLM, if true, reads the usage of a 2xx answer (an OpenAI-compatible
	// chat completion or an Anthropic message: usage.prompt_tokens and
	// completion_tokens, or input_tokens and output_tokens) and settles
	// the task's turn to it: each limit of its rule whose cost is an
	// estimate (rules.CostConfig.Estimate) is charged what the call used,
	// in one script call when the handler returns.
	LLM bool
	// Usage, if set, says where the answers of an API of another shape
	// report their usage: the input and output tokens at these paths
	// settle the task's turn as LLM's do. It needs LLM.
	Usage *UsagePaths
	// LimitWindow is the window over which the provider of an LLM call
	// (LLM) counts the limits its headers announce
	// (httpthrottle.ParseProviderHeaders); if zero, DefaultLimitWindow.
	// Each announced limit binds the limit of the handler's rule that
	// counts the same thing, fleet-wide, where it is slower (a minute's
	// limit read as LearnedShare of it per LimitWindow).
	LimitWindow time.Duration

	url *urlTemplate
}

// Header is one request header. Value may hold ${VAR} references to the
// worker's environment, resolved when the handlers are built and never
// logged.
type Header struct {
	Name, Value string
}

// EnvVar is one variable of a command's environment. Value may hold
// ${VAR} references to the worker's environment.
type EnvVar struct {
	Name, Value string
}

// CommandSpec is a command handler: argv run without a shell, the task's
// payload on its stdin.
type CommandSpec struct {
	// Argv is the program and its arguments. An argument that is exactly
	// {field} is replaced by that payload field's value, as one whole
	// argument; the program (Argv[0]) is always literal.
	Argv    []string
	Env     []EnvVar // in file order
	Timeout time.Duration
	// StopGrace is how long the command's processes have to end after
	// SIGTERM (at the timeout, or when the task is cancelled) before
	// SIGKILL; 0 sends SIGKILL right after SIGTERM. ParseConfig sets
	// DefaultStopGrace unless the file says otherwise.
	StopGrace time.Duration
	// NoRetryExitCodes archive the task at once (no retry); other non-zero
	// codes are retried.
	NoRetryExitCodes []int
}

// LoadConfig reads the handlers section of the rules file at path.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("handler: reading rules file: %w", err)
	}
	return ParseConfig(path, data)
}

// ParseConfig reads the handlers section of a rules file (the rest of the
// file is rules.Parse's); name is used in messages. It returns a
// *rules.Error naming the line and the field for the first
// problem found. A file without a handlers section gives an empty Config.
// A worker that parses the file with rules.Parse reads the section it
// holds with FromRules instead.
func ParseConfig(name string, data []byte) (*Config, error) {
	p := newParser(name)
	root, err := p.Root(data, "rules", "the file is empty")
	if err != nil {
		return nil, err
	}
	var list *yaml.Node
	if root = yamlfile.Resolve(root); root.Kind == yaml.MappingNode { // else rules.Parse reports it
		for i := 0; i+1 < len(root.Content); i += 2 {
			if root.Content[i].Value == "handlers" {
				list = root.Content[i+1]
			}
		}
	}
	return p.config(list)
}

// FromRules reads the handlers section of the rules file cfg was parsed
// from (rules.Config.HandlersSection), as ParseConfig reads it from the
// file.
func FromRules(cfg *rules.Config) (*Config, error) {
	return newParser(cfg.File).config(cfg.HandlersSection())
}

// newParser reads the handlers section of the file name.
func newParser(name string) *parser {
	p := &parser{file: name}
	p.Reader = yamlfile.Reader{
		Fail: func(line int, field, reason string) error {
			return &rules.Error{File: name, Line: line, Field: field, Reason: reason}
		},
		DurationExamples: "10s, 500ms or 2m",
		DurationSyntax:   "(ms, s, m, h), such as 10s or 2m",
	}
	return p
}

// config reads the handlers section list (nil: none).
func (p *parser) config(list *yaml.Node) (*Config, error) {
	c := &Config{File: p.file}
	if list == nil {
		return c, nil
	}
	if list = yamlfile.Resolve(list); list.Kind != yaml.SequenceNode {
		return nil, p.Failf(list, "handlers", "%s must be a list of handlers, each with task and http or command", yamlfile.Describe(list))
	}
	seen := map[string]int{}
	for i, n := range list.Content {
		s, err := p.spec(yamlfile.Resolve(n), "handlers["+strconv.Itoa(i+1)+"]", seen)
		if err != nil {
			return nil, err
		}
		c.Handlers = append(c.Handlers, s)
	}
	return c, nil
}

// Handler returns the handler of task type task.
func (c *Config) Handler(task string) (Spec, bool) {
	for _, s := range c.Handlers {
		if s.Task == task {
			return s, true
		}
	}
	return Spec{}, false
}

var (
	// placeholderRE is a {field} placeholder.
	placeholderRE = regexp.MustCompile(`\{([A-Za-z0-9_-]+)\}`)
	// envRefRE is a ${VAR} reference.
	envRefRE  = regexp.MustCompile(`\$\{([^}]*)\}`)
	envNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	// headerNameRE is an HTTP field name (RFC 9110 token).
	headerNameRE = regexp.MustCompile("^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
)

type parser struct {
	yamlfile.Reader
	file string
}

// spec reads the handler at n, at path: seen holds the task types of the
// handlers before it (task type → line).
func (p *parser) spec(n *yaml.Node, path string, seen map[string]int) (Spec, error) {
	s := Spec{Line: n.Line, ResultLimit: DefaultResultLimit}
	_, err := p.Fields(n, path, "a handler", []yamlfile.Field{
		{Key: "task", Missing: "give the task type this handler runs, such as partner:sync", Read: yamlfile.Into(&s.Task, func(v *yaml.Node, field string) (string, error) {
			return p.task(v, field, seen)
		})},
		{Key: "http", Read: yamlfile.Into(&s.HTTP, p.http)},
		{Key: "command", Read: func(v *yaml.Node, field string) (err error) {
			if s.HTTP != nil {
				return p.Failf(v, field, "cannot be combined with http; a handler runs one of them")
			}
			s.Command, err = p.command(v, field)
			return err
		}, Check: func() error {
			if s.HTTP == nil && s.Command == nil {
				return p.Failf(n, path, "needs http (call an API) or command (run a program)")
			}
			return nil
		}},
		{Key: "result_limit", Read: p.IntTo(&s.ResultLimit, 0, MaxResultLimit)},
	})
	return s, err
}

// task reads a handler's task type: one exact type, not in seen (task
// type → line), which it is added to.
func (p *parser) task(n *yaml.Node, field string, seen map[string]int) (string, error) {
	task, err := p.Str(n, field)
	if err != nil {
		return "", err
	}
	if task == "" || strings.ContainsAny(task, "* \t\n") {
		return "", p.Failf(n, field, "%q: give one exact task type, such as partner:sync (no patterns, no spaces)", task)
	}
	if line, dup := seen[task]; dup {
		return "", p.Failf(n, field, "%q also has the handler on line %d; a task type takes one handler", task, line)
	}
	seen[task] = n.Line
	return task, nil
}

// http reads an http handler, the mapping n at path.
func (p *parser) http(n *yaml.Node, path string) (*HTTPSpec, error) {
	h := &HTTPSpec{Method: http.MethodPost, Timeout: DefaultHTTPTimeout}
	fields, err := p.Fields(n, path, "http", []yamlfile.Field{
		{Key: "method", Read: yamlfile.Into(&h.Method, p.method)},
		{Key: "url", Missing: `give the URL, such as "https://api.example.com/v1/accounts/{account_id}"`, Read: func(v *yaml.Node, field string) (err error) {
			if h.URL, err = p.Str(v, field); err != nil {
				return err
			}
			if h.url, err = parseURLTemplate(h.URL); err != nil {
				return p.Failf(v, field, "%q: %v", h.URL, err)
			}
			return nil
		}},
		{Key: "headers", Read: yamlfile.Into(&h.Headers, p.headers)},
		{Key: "timeout", Read: p.DurationTo(&h.Timeout, time.Millisecond, MaxTimeout)},
		{Key: "idempotency_header"}, // idempotencyHeader
		{Key: "llm", Read: p.BoolTo(&h.LLM)},
		{Key: "usage", Read: yamlfile.Into(&h.Usage, p.usage)},
		{Key: "limit_window", Read: p.DurationTo(&h.LimitWindow, time.Millisecond, MaxTimeout)},
	})
	if err != nil {
		return nil, err
	}
	if h.IdempotencyHeader, err = p.idempotencyHeader(fields, path, h.Headers); err != nil {
		return nil, err
	}
	for _, f := range []string{"usage", "limit_window"} {
		if fields[f] != nil && !h.LLM {
			return nil, p.Failf(fields[f], yamlfile.Join(path, f), "needs llm: true: it reads an LLM call's answers")
		}
	}
	return h, nil
}

// method reads an http method.
func (p *parser) method(n *yaml.Node, field string) (string, error) {
	m, err := p.Str(n, field)
	if err != nil {
		return "", err
	}
	switch m {
	case http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete:
		return m, nil
	}
	return "", p.Failf(n, field, "%q: use GET, POST, PUT, PATCH or DELETE (upper case)", m)
}

// headers reads an http handler's headers, in file order.
func (p *parser) headers(n *yaml.Node, field string) ([]Header, error) {
	m, err := p.stringMap(n, field, "a mapping of header names to values, such as {Authorization: \"Bearer ${TOKEN}\"}")
	if err != nil {
		return nil, err
	}
	var hs []Header
	for _, kv := range m {
		if !headerNameRE.MatchString(kv.name) {
			return nil, p.Failf(kv.node, field, "%q is not a valid header name", kv.name)
		}
		if strings.ContainsAny(kv.value, "\r\n") {
			return nil, p.Failf(kv.node, yamlfile.Join(field, kv.name), "must be one line")
		}
		hs = append(hs, Header{Name: http.CanonicalHeaderKey(kv.name), Value: kv.value})
	}
	return hs, nil
}

// idempotencyHeader reads idempotency_header of the http mapping whose
// fields are given: a header name, or "" for none; the default if it is
// not set. headers must not set it too.
func (p *parser) idempotencyHeader(fields map[string]*yaml.Node, path string, headers []Header) (string, error) {
	name := DefaultIdempotencyHeader
	if n := fields["idempotency_header"]; n != nil {
		var err error
		if name, err = p.headerName(n, yamlfile.Join(path, "idempotency_header")); err != nil {
			return "", err
		}
	}
	for _, hd := range headers {
		if hd.Name == name {
			return "", p.Failf(fields["headers"], yamlfile.Join(path, "headers."+hd.Name),
				"is the idempotency header, which carries the task ID: remove it here, or set idempotency_header to another name (\"\" for none)")
		}
	}
	return name, nil
}

// headerName reads idempotency_header's value: a header name, or "".
func (p *parser) headerName(n *yaml.Node, field string) (string, error) {
	if n.ShortTag() == "!!null" {
		return "", p.Failf(n, field, `an empty value: write "" to send no idempotency header, or a header name such as Idempotency-Key`)
	}
	name, err := p.Str(n, field)
	if err != nil {
		return "", err
	}
	if name == "" {
		return "", nil
	}
	if !headerNameRE.MatchString(name) {
		return "", p.Failf(n, field, "%q is not a valid header name; give one such as Idempotency-Key, or \"\" to send none", name)
	}
	return http.CanonicalHeaderKey(name), nil
}

// command reads a command handler, the mapping n at path.
func (p *parser) command(n *yaml.Node, path string) (*CommandSpec, error) {
	c := &CommandSpec{Timeout: DefaultCommandTimeout, StopGrace: DefaultStopGrace, NoRetryExitCodes: []int{DefaultNoRetryExitCode}}
	_, err := p.Fields(n, path, "command", []yamlfile.Field{
		{Key: "argv", Missing: `give the program and its arguments as a list, such as ["/usr/local/bin/render", "--tenant", "{tenant}"]`, Read: yamlfile.Into(&c.Argv, p.argv)},
		{Key: "env", Read: yamlfile.Into(&c.Env, p.env)},
		{Key: "timeout", Read: p.DurationTo(&c.Timeout, time.Millisecond, MaxTimeout)},
		{Key: "stop_grace", Read: p.DurationTo(&c.StopGrace, 0, MaxStopGrace)},
		{Key: "no_retry_exit_codes", Read: yamlfile.Into(&c.NoRetryExitCodes, p.exitCodes)},
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// env reads a command's environment, in file order.
func (p *parser) env(n *yaml.Node, field string) ([]EnvVar, error) {
	m, err := p.stringMap(n, field, "a mapping of variable names to values, such as {API_TOKEN: \"${API_TOKEN}\"}")
	if err != nil {
		return nil, err
	}
	var env []EnvVar
	for _, kv := range m {
		if !envNameRE.MatchString(kv.name) {
			return nil, p.Failf(kv.node, field, "%q is not a variable name; use letters, digits and '_'", kv.name)
		}
		env = append(env, EnvVar{Name: kv.name, Value: kv.value})
	}
	return env, nil
}

// exitCodes reads no_retry_exit_codes: a list of codes from 1 to 255,
// each kept once; [] for none.
func (p *parser) exitCodes(n *yaml.Node, field string) ([]int, error) {
	if n.Kind != yaml.SequenceNode {
		return nil, p.Failf(n, field, "%s must be a list of exit codes from 1 to 255, such as [65]; [] for none", yamlfile.Describe(n))
	}
	codes := []int{}
	for _, cn := range n.Content {
		code, err := p.Int(yamlfile.Resolve(cn), field, 1, 255)
		if err != nil {
			return nil, err
		}
		if !slices.Contains(codes, code) {
			codes = append(codes, code)
		}
	}
	return codes, nil
}

// argv reads a command's argv, the node an: the program (literal) and
// its arguments, each a literal or a whole {field}.
func (p *parser) argv(an *yaml.Node, field string) ([]string, error) {
	an = yamlfile.Resolve(an)
	if an.Kind != yaml.SequenceNode || len(an.Content) == 0 {
		return nil, p.Failf(an, field, `%s must be a list of at least the program, such as ["/usr/local/bin/render", "{tenant}"]`, yamlfile.Describe(an))
	}
	var argv []string
	for i, v := range an.Content {
		v = yamlfile.Resolve(v)
		vf := field + "[" + strconv.Itoa(i+1) + "]"
		if v.Kind != yaml.ScalarNode || (v.ShortTag() != "!!str" && v.ShortTag() != "!!int") {
			return nil, p.Failf(v, vf, "%s must be a string", yamlfile.Describe(v))
		}
		if i == 0 {
			if v.Value == "" || placeholderRE.MatchString(v.Value) {
				return nil, p.Failf(v, vf, "%q: the program must be a literal path or name, never taken from the payload", v.Value)
			}
		} else if _, whole := wholePlaceholder(v.Value); !whole && placeholderRE.MatchString(v.Value) {
			return nil, p.Failf(v, vf, "%q: a payload field fills a whole argument only; write it as its own element, such as [\"--tenant\", \"{tenant}\"]", v.Value)
		}
		argv = append(argv, v.Value)
	}
	return argv, nil
}

type namedValue struct {
	name, value string
	node        *yaml.Node
}

// stringMap reads a mapping of names to string values whose ${VAR}
// references are well formed, in file order.
func (p *parser) stringMap(n *yaml.Node, path, what string) ([]namedValue, error) {
	n = yamlfile.Resolve(n)
	if n.Kind != yaml.MappingNode {
		return nil, p.Failf(n, path, "%s must be %s", yamlfile.Describe(n), what)
	}
	var out []namedValue
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := yamlfile.Resolve(n.Content[i]), yamlfile.Resolve(n.Content[i+1])
		if k.Kind != yaml.ScalarNode {
			return nil, p.Failf(k, path, "must be %s", what)
		}
		field := yamlfile.Join(path, k.Value)
		if line, dup := seen[strings.ToLower(k.Value)]; dup {
			return nil, p.Failf(k, field, "repeats the name set on line %d; give it once", line)
		}
		seen[strings.ToLower(k.Value)] = k.Line
		if v.Kind != yaml.ScalarNode || v.ShortTag() == "!!null" || v.ShortTag() == "!!map" || v.ShortTag() == "!!seq" {
			return nil, p.Failf(v, field, "%s must be a string", yamlfile.Describe(v))
		}
		for _, m := range envRefRE.FindAllStringSubmatch(v.Value, -1) {
			if !envNameRE.MatchString(m[1]) {
				return nil, p.Failf(v, field, "%q is not an environment variable reference; write ${NAME} with letters, digits and '_'", m[0])
			}
		}
		out = append(out, namedValue{name: k.Value, value: v.Value, node: k})
	}
	return out, nil
}

// EnvRefs returns the names of the environment variables value refers to
// with ${NAME}.
func EnvRefs(value string) []string {
	var names []string
	for _, m := range envRefRE.FindAllStringSubmatch(value, -1) {
		names = append(names, m[1])
	}
	return names
}

// expandEnv replaces each ${NAME} of value with getenv(NAME); a variable
// that is unset or empty is an error naming it (never its value).
func expandEnv(value string, getenv func(string) string) (string, error) {
	var missing string
	out := envRefRE.ReplaceAllStringFunc(value, func(ref string) string {
		name := ref[2 : len(ref)-1]
		v := getenv(name)
		if v == "" && missing == "" {
			missing = name
		}
		return v
	})
	if missing != "" {
		return "", fmt.Errorf("environment variable %s is not set; set it in the worker's environment", missing)
	}
	return out, nil
}

// urlTemplate is a parsed http url: a fixed scheme and host, then path
// and query parts with placeholders.
type urlTemplate struct {
	origin string // scheme://host[:port], never from a payload
	parts  []urlPart
}

type urlPart struct {
	literal string
	field   string // a placeholder if not ""
	query   bool   // the placeholder is in the query
}

// parseURLTemplate checks that raw is an http or https URL whose scheme
// and host are literal, and splits the rest into parts.
func parseURLTemplate(raw string) (*urlTemplate, error) {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok || (scheme != "http" && scheme != "https") {
		return nil, fmt.Errorf("must start with http:// or https://")
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	host := rest[:end]
	if host == "" || strings.ContainsAny(host, "{}@") {
		return nil, fmt.Errorf("the host must be written out in the file (no placeholders, no user:password@)")
	}
	tail := rest[end:]
	if strings.Contains(tail, "#") {
		return nil, fmt.Errorf("a URL sent to a server has no #fragment; remove it")
	}
	u, err := url.Parse(placeholderRE.ReplaceAllString(raw, "x"))
	if err != nil {
		return nil, fmt.Errorf("is not a URL: %v", err.(*url.Error).Err)
	}
	if u.Host != host {
		return nil, fmt.Errorf("the host %q does not parse as one", host)
	}
	t := &urlTemplate{origin: scheme + "://" + host}
	query := false
	for len(tail) > 0 {
		loc := placeholderRE.FindStringSubmatchIndex(tail)
		if loc == nil {
			t.parts = append(t.parts, urlPart{literal: tail})
			break
		}
		lit := tail[:loc[0]]
		if strings.Contains(lit, "?") {
			query = true
		}
		if strings.ContainsAny(lit, "{}") {
			return nil, fmt.Errorf("%q: a placeholder is {field} with letters, digits, '-' and '_'", lit)
		}
		t.parts = append(t.parts, urlPart{literal: lit}, urlPart{field: tail[loc[2]:loc[3]], query: query})
		tail = tail[loc[1]:]
	}
	if last := t.parts; len(last) > 0 && strings.ContainsAny(last[len(last)-1].literal, "{}") {
		return nil, fmt.Errorf("a placeholder is {field} with letters, digits, '-' and '_'")
	}
	return t, nil
}

// Describe says what s runs, in one line, for `worker --check`. It
// names header and env variables and the ${VAR}s they come from, never
// their values.
func (s Spec) Describe() string {
	var b strings.Builder
	secrets := func(name, value string) string {
		if refs := EnvRefs(value); len(refs) > 0 {
			return name + " from ${" + strings.Join(refs, "}, ${") + "}"
		}
		return name
	}
	switch {
	case s.HTTP != nil:
		h := s.HTTP
		fmt.Fprintf(&b, "http %s %s, timeout %v", h.Method, h.URL, h.Timeout)
		if h.IdempotencyHeader != "" {
			fmt.Fprintf(&b, ", task ID in %s", h.IdempotencyHeader)
		} else {
			b.WriteString(", no idempotency header")
		}
		if len(h.Headers) > 0 {
			var names []string
			for _, hd := range h.Headers {
				names = append(names, secrets(hd.Name, hd.Value))
			}
			fmt.Fprintf(&b, ", headers: %s", strings.Join(names, "; "))
		}
		if h.LLM {
			b.WriteString(", an LLM call settled to its answer's usage")
		}
		if h.Usage != nil {
			fmt.Fprintf(&b, " (input tokens at %s, output tokens at %s)", h.Usage.Input, h.Usage.Output)
		}
	case s.Command != nil:
		c := s.Command
		fmt.Fprintf(&b, "command %q, timeout %v, SIGKILL %v after SIGTERM", c.Argv, c.Timeout, c.StopGrace)
		if len(c.Env) > 0 {
			var names []string
			for _, e := range c.Env {
				names = append(names, secrets(e.Name, e.Value))
			}
			fmt.Fprintf(&b, ", env: %s", strings.Join(names, "; "))
		}
		fmt.Fprintf(&b, ", no retry on exit codes %v", c.NoRetryExitCodes)
	}
	fmt.Fprintf(&b, ", result up to %d bytes", s.ResultLimit)
	return b.String()
}
