//! `bench_sqs`: see [`brokerfence_bench::bench_sqs`].

fn main() -> std::process::ExitCode {
    brokerfence_bench::bench_sqs::main()
}
