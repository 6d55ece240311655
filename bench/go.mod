module github.com/tollgate-go/tollgate/bench

go 1.26.8

require (
	github.com/sethvargo/go-limiter v0.7.1
	github.com/tollgate-go/tollgate v0.0.0
	golang.org/x/time v0.16.0
)

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/redis/go-redis/v9 v9.23.0 // indirect
	go.uber.org/atomic v1.12.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
)

replace github.com/tollgate-go/tollgate => ../
