package throttle

// EncodeSubject lets the external tests (fuzz_test.go, backends_test.go)
// check and build keys by the subject encoding, which the package keeps
// unexported (its doc describes it).
var EncodeSubject = encodeSubject
