package throttle

// FixedWindow: lua/fixedwindow.lua keeps one counter per key (the latest
// window holding permits), so a backlog booked ahead costs nothing more.
var _ = register(FixedWindow, &algorithm{rank: 1, files: []string{"fixedwindow.lua"}})
