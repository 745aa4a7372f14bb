// Package reliability holds jobthrottle's fault, bad-input, load and
// security tests: they run the library (and, where noted, the worker and
// enqueue binaries) against real redis-server processes that the tests
// start, kill, restart, fail over and misconfigure on loopback.
//
// The package has no code of its own; RELIABILITY.md at the repository root
// lists every test, what it asserts, how to run the long versions and the
// figures measured.
package reliability
