//! The `kvroute-agent` process: its command line and how `kvroute_runtime::main` runs it
//! (config file, reloaded when it changes; ready file `admin=ADDR`; shutdown).

use std::net::SocketAddr;

use clap::Parser;
use kvroute_runtime::process::{BoxError, Component, Running, ServerArgs, StartError, read_config};

use crate::{Agent, AgentConfig};

/// `kvroute-agent --config agent.yaml`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "kvroute agent: mirrors local vLLM KV events, streams them to kvroute-index"
)]
pub struct Args {
    /// `--config`, `--ready-file`.
    #[command(flatten)]
    pub server: ServerArgs,
}

/// The agent as a process.
#[derive(Debug)]
pub struct Process;

impl Component for Process {
    const NAME: &'static str = "kvroute-agent";
    type Args = Args;
    type Config = AgentConfig;
    type Running = Agent;

    fn server_args(args: &Args) -> &ServerArgs {
        &args.server
    }

    fn load(args: &Args) -> Result<AgentConfig, BoxError> {
        let text = read_config(&args.server.config)?;
        Ok(AgentConfig::from_yaml(&text)?)
    }

    async fn start(config: AgentConfig, args: Args) -> Result<Agent, StartError> {
        Agent::start_reloading(config, args.server.config)
            .await
            .map_err(StartError::failed)
    }
}

impl Running for Agent {
    /// `admin=ADDR` only: the agent listens for nothing else.
    fn ready_lines(&self) -> Vec<(&'static str, SocketAddr)> {
        vec![("admin", self.admin_addr())]
    }

    /// Never: the agent has no server whose loss should stop it (its admin server only
    /// observes; streams to the indexes reconnect).
    async fn failed(&mut self) -> String {
        std::future::pending().await
    }

    async fn shutdown(self) -> Result<(), BoxError> {
        Agent::shutdown(self).await;
        Ok(())
    }
}
