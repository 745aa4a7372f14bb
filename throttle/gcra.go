package throttle

// GCRA: lua/bucket.lua's exact arithmetic, which it shares with
// TokenBucket, and lua/gcra.lua.
var _ = register(GCRA, &algorithm{rank: 5, files: []string{"bucket.lua", "bucket_rare.lua", "gcra.lua"}, bucket: true, validate: validateBurst})
