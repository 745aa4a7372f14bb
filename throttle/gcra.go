package throttle

// GCRA: lua/bucket.lua's exact arithmetic, which it shares with
// TokenBucket, and lua/gcra.lua.
var _ = register(GCRA, &algorithm{name: "gcra", aliases: []string{"leaky_bucket"}, files: []string{"bucket.lua", "gcra.lua"}, bucket: true, validate: validateBurst})
